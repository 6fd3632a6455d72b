// The realtime page: a video source (camera, screen or a local file) sampled to JPEG frames and sent through this
// server's WS /v1/video/realtime (docs/architecture.md, "Realtime sessions in sglang"); the answers shown per turn
// as they stream. Model text is only ever inserted as text (text nodes), never as HTML.
"use strict";

(() => {
  const SOCKET_PATH = "/v1/video/realtime";
  const LONG_EDGE = 512; // frames are scaled down to at most this many pixels on their long edge
  const JPEG_QUALITY = 0.65;
  // A tick is skipped while this much is still unsent on the socket: a slow uplink must not make frames stale.
  const MAX_BUFFERED_BYTES = 512 * 1024;
  const CAPACITY_CODES = ["session_capacity_exceeded", "insufficient_kv_capacity"];

  const $ = (id) => document.getElementById(id);
  const video = $("video");
  const canvas = document.createElement("canvas");
  let session = null; // the current session's state (see start())

  function setText(id, value) {
    $(id).textContent = String(value);
  }

  function setStatus(text, kind) {
    const status = $("status");
    status.textContent = text;
    status.className = "status" + (kind ? " " + kind : "");
  }

  function showError(code, message) {
    const item = document.createElement("li");
    item.textContent = code + ": " + message;
    $("errors").appendChild(item);
  }

  function secureContextNote() {
    $("secure-note").hidden = Boolean(window.isSecureContext && navigator.mediaDevices);
  }

  // ------------------------------------------------------------------------------------------------ sources

  function stopTracks() {
    const stream = video.srcObject;
    if (stream) stream.getTracks().forEach((track) => track.stop());
    video.srcObject = null;
  }

  async function openSource(kind) {
    if (kind === "file") {
      const file = $("file").files[0];
      if (!file) throw new Error("choose a video file first");
      stopTracks();
      if (video.src) URL.revokeObjectURL(video.src);
      video.src = URL.createObjectURL(file);
      await video.play();
      return;
    }
    if (!window.isSecureContext || !navigator.mediaDevices) {
      throw new Error("the " + kind + " needs a page opened on localhost or over HTTPS (see the note)");
    }
    const stream =
      kind === "camera"
        ? await navigator.mediaDevices.getUserMedia({ video: { width: { ideal: 1280 }, height: { ideal: 720 } } })
        : await navigator.mediaDevices.getDisplayMedia({ video: true, audio: false });
    stopTracks();
    video.removeAttribute("src");
    video.srcObject = stream;
    await video.play();
  }

  // Seconds on one session clock that never goes backwards: wall time for a camera or a screen, the file's
  // currentTime for a file (a seek back re-anchors it); a switch of source continues from the last timestamp.
  function anchorClock(s, kind) {
    s.kind = kind;
    s.wallStart = performance.now();
    s.base = s.lastTimestamp;
    s.lastFileTime = 0;
  }

  function frameTimestamp(s) {
    let t;
    if (s.kind === "file") {
      const current = video.currentTime;
      if (current < s.lastFileTime) s.base = s.lastTimestamp - current;
      s.lastFileTime = current;
      t = s.base + current;
    } else {
      t = s.base + (performance.now() - s.wallStart) / 1000;
    }
    t = Math.max(Math.round(t * 1000) / 1000, s.lastTimestamp);
    s.lastTimestamp = t;
    return t;
  }

  // ------------------------------------------------------------------------------------------------ sending

  function send(s, event) {
    s.ws.send(JSON.stringify(event));
  }

  function takeSeqNo(s) {
    const seqNo = s.nextSeqNo;
    s.nextSeqNo += 1;
    return seqNo;
  }

  // One frame in flight (from its metadata to its input.frame.accepted): a tick that finds one still travelling,
  // or nothing new to show, is skipped, never queued (the server ends a session whose input queue overflows).
  function tick(s) {
    if (session !== s || !s.ready || s.ended) return;
    const fileStill = s.kind === "file" && (video.paused || video.ended);
    if (s.frame || s.ws.bufferedAmount >= MAX_BUFFERED_BYTES || video.readyState < 2 || !video.videoWidth || fileStill) {
      s.skipped += 1;
      setText("ticks-skipped", s.skipped);
      return;
    }
    const scale = Math.min(1, LONG_EDGE / Math.max(video.videoWidth, video.videoHeight));
    canvas.width = Math.max(1, Math.round(video.videoWidth * scale));
    canvas.height = Math.max(1, Math.round(video.videoHeight * scale));
    canvas.getContext("2d").drawImage(video, 0, 0, canvas.width, canvas.height);
    const frame = { seqNo: takeSeqNo(s), timestamp: frameTimestamp(s), bytes: null };
    s.frame = frame;
    canvas.toBlob(
      async (blob) => {
        // Sent as an ArrayBuffer, not the Blob: bufferedAmount then counts it, and DevTools sees its bytes.
        const bytes = blob ? await blob.arrayBuffer() : null;
        if (s.ended || s.frame !== frame) return;
        if (!bytes) {
          s.frame = null;
          s.nextSeqNo = frame.seqNo;
          return;
        }
        frame.bytes = bytes;
        send(s, { type: "input.frame", seq_no: frame.seqNo, timestamp: frame.timestamp, mime_type: "image/jpeg" });
      },
      "image/jpeg",
      JPEG_QUALITY,
    );
  }

  // A question goes as input.prompt as soon as no frame is in flight (its seq_no comes from the same counter).
  // Latency is measured between event timestamps (``at``: the triggering DOM event's timeStamp).
  function sendQuestion(s, at) {
    if (!s.question || s.frame || !s.ready || s.ended) return;
    const seqNo = takeSeqNo(s);
    send(s, { type: "input.prompt", seq_no: seqNo, prompt: s.question });
    s.firstToken = { seqNo, sentAt: at, turnAtSend: s.turnId, turn: null, measured: false };
    s.question = null;
  }

  // ------------------------------------------------------------------------------------------------ turns

  function closeAnswer(s, mark) {
    if (s.answer) {
      if (mark) s.answer.item.classList.add(mark);
      s.answer = null;
    }
    s.silent = null;
    setAnswering(s, false);
  }

  function answerFor(s, turnId) {
    if (s.answer && s.answer.turnId === turnId) return s.answer;
    closeAnswer(s, null);
    const item = document.createElement("li");
    item.className = "answer";
    item.dataset.turn = String(turnId);
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = "turn " + turnId;
    const text = document.createTextNode("");
    item.append(meta, text);
    $("turns").appendChild(item);
    s.answer = { turnId, item, meta, text };
    return s.answer;
  }

  function markSilence(s, turnId) {
    if (s.answer) {
      closeAnswer(s, null);
      return;
    }
    if (!s.silent) {
      const item = document.createElement("li");
      item.className = "silent";
      item.dataset.turn = String(turnId);
      $("turns").appendChild(item);
      s.silent = { item, count: 0 };
    }
    s.silent.count += 1;
    s.silent.item.textContent = "(silent" + (s.silent.count > 1 ? " \u00d7" + s.silent.count : "") + ")";
  }

  function onDelta(s, event, at) {
    const answer = answerFor(s, event.turn_id);
    answer.text.appendData(event.delta);
    setAnswering(s, true);
    const first = s.firstToken;
    if (first && !first.measured) {
      const turn = first.turn !== null ? first.turn : event.turn_id > first.turnAtSend ? event.turn_id : null;
      if (turn === event.turn_id) {
        first.measured = true;
        const ms = Math.round(at - first.sentAt);
        setText("latency", ms + " ms");
        answer.meta.textContent = "turn " + event.turn_id + " \u00b7 first token after " + ms + " ms";
      }
    }
    $("turns").scrollTop = $("turns").scrollHeight;
  }

  function setAnswering(s, answering) {
    s.answering = answering;
    updateSendButton(s);
  }

  // While the model answers, the button stops it, unless a question is typed: that one barges in.
  function updateSendButton(s) {
    const stop = Boolean(s && s.answering && !s.ended && !$("question").value.trim());
    const button = $("send");
    button.textContent = stop ? "Stop" : "Send";
    button.classList.toggle("stop", stop);
  }

  // ------------------------------------------------------------------------------------------------ events

  function handle(s, event, at) {
    switch (event.type) {
      case "session.created":
        s.created = true;
        send(s, s.configure);
        setStatus("configuring");
        break;
      case "session.configured":
        setStatus("starting");
        break;
      case "session.ready":
        s.ready = true;
        s.turnId = event.turn_id;
        anchorClock(s, s.kind);
        s.timer = setInterval(() => tick(s), 1000 / s.fps);
        setStatus("live", "live");
        $("question").disabled = false;
        $("send").disabled = false;
        sendQuestion(s, at);
        break;
      case "input.frame.ready":
        if (s.frame && s.frame.seqNo === event.seq_no) s.ws.send(s.frame.bytes);
        break;
      case "input.frame.accepted":
        if (s.frame && s.frame.seqNo === event.seq_no) s.frame = null;
        s.framesSent += 1;
        setText("frames-sent", s.framesSent);
        setText("pending", event.pending_events);
        sendQuestion(s, at);
        break;
      case "input.prompt.accepted":
        setText("pending", event.pending_events);
        break;
      case "input.frame.processed":
      case "input.prompt.processed":
        if (event.type === "input.frame.processed") {
          s.framesProcessed += 1;
          setText("frames-processed", s.framesProcessed);
        }
        setText("pending", event.pending_events);
        if (event.turn_id !== undefined && s.firstToken && s.firstToken.seqNo === event.seq_no) {
          s.firstToken.turn = event.turn_id;
        }
        break;
      case "response.text.delta":
        onDelta(s, event, at);
        break;
      case "response.turn.silence":
        markSilence(s, event.turn_id);
        break;
      case "response.turn.interrupted":
        closeAnswer(s, "interrupted");
        s.turnId = event.next_turn_id;
        if (s.firstToken && s.firstToken.seqNo === event.seq_no) s.firstToken.turn = event.next_turn_id;
        break;
      case "response.done":
        closeAnswer(s, null);
        setStatus("done (" + event.finish_reason + ")");
        break;
      case "session.usage":
        setText(
          "usage",
          Object.entries(event)
            .filter(([name]) => name !== "type")
            .map(([name, value]) => name + "=" + value)
            .join(", "),
        );
        break;
      case "session.done":
        end(s, event.aborted ? "session ended (aborted)" : "session ended");
        break;
      case "error":
        onError(s, event);
        break;
      default:
        break;
    }
  }

  function onError(s, event) {
    showError(event.code, event.message);
    if (CAPACITY_CODES.includes(event.code)) {
      setStatus("server full", "failed");
      showError("server full", "the server holds as many realtime sessions as it can; try again in a moment");
      return;
    }
    // A refused input leaves its seq_no free: the next input takes it again.
    if (typeof event.seq_no === "number" && event.seq_no < s.nextSeqNo) {
      if (s.frame && s.frame.seqNo >= event.seq_no) s.frame = null;
      s.nextSeqNo = event.seq_no;
    }
  }

  // ------------------------------------------------------------------------------------------------ lifecycle

  function end(s, text) {
    if (s.ended) return;
    s.ended = true;
    clearInterval(s.timer);
    closeAnswer(s, null);
    setStatus(text, text.startsWith("session ended") ? "" : "failed");
    $("start").disabled = false;
    $("hangup").disabled = true;
    $("question").disabled = true;
    $("send").disabled = true;
    lockSettings(false);
    if (s.ws.readyState === WebSocket.OPEN || s.ws.readyState === WebSocket.CONNECTING) s.ws.close();
  }

  function abort(s) {
    if (s.ended) return;
    if (s.ws.readyState === WebSocket.OPEN) send(s, { type: "session.abort" });
    else end(s, "session ended");
  }

  // A refused handshake reaches a page only as a closed socket: ask the HTTP side (same key) why.
  async function explainRefusal(s) {
    let status = 0;
    try {
      const headers = s.key ? { Authorization: "Bearer " + s.key } : {};
      status = (await fetch(SOCKET_PATH + "/capabilities", { headers })).status;
    } catch (error) {
      status = 0;
    }
    if (status === 401 || status === 403) {
      const why = s.key ? "refused the API key" : "needs an API key";
      showError("unauthorized", "the server " + why + " (HTTP " + status + "): type the key it was started with");
      end(s, "refused: API key");
    } else {
      showError("unreachable", "could not open the realtime socket (is the server up, with a MOSS-VL model?)");
      end(s, "no connection");
    }
  }

  function lockSettings(locked) {
    for (const id of ["fps", "system-prompt", "temperature", "max-new-tokens", "api-key"]) $(id).disabled = locked;
  }

  function configureEvent() {
    const event = {
      type: "session.configure",
      temperature: Number($("temperature").value) || 0,
      max_new_tokens: Math.max(1, Math.round(Number($("max-new-tokens").value) || 256)),
      include_usage: true,
    };
    const system = $("system-prompt").value.trim();
    if (system) event.system_prompt = system;
    return event;
  }

  function connect(s) {
    const protocols = ["realtime"];
    if (s.key) protocols.push("openai-insecure-api-key." + s.key);
    try {
      s.ws = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + SOCKET_PATH, protocols);
    } catch (error) {
      showError("api key", "a browser cannot send this key (" + error.message + ")");
      s.ws = { readyState: WebSocket.CLOSED, close() {} };
      end(s, "refused: API key");
      return;
    }
    s.ws.binaryType = "arraybuffer";
    s.ws.onopen = () => {
      s.opened = true;
    };
    s.ws.onmessage = (message) => {
      if (typeof message.data === "string") handle(s, JSON.parse(message.data), message.timeStamp);
    };
    s.ws.onclose = (close) => {
      if (s.ended) return;
      if (!s.opened) explainRefusal(s);
      else if (close.code === 1013 && !s.created) end(s, "server full");
      else end(s, s.created ? "connection closed (" + close.code + ")" : "server full");
    };
  }

  async function start() {
    $("errors").replaceChildren();
    $("turns").replaceChildren();
    for (const id of ["frames-sent", "frames-processed", "ticks-skipped", "pending"]) setText(id, 0);
    setText("latency", "-");
    setText("usage", "-");
    const kind = $("source").value;
    $("start").disabled = true;
    try {
      await openSource(kind);
    } catch (error) {
      showError("source", error.message);
      $("start").disabled = false;
      return;
    }
    const s = {
      kind,
      fps: Number($("fps").value),
      key: $("api-key").value,
      configure: configureEvent(),
      nextSeqNo: 0,
      lastTimestamp: 0,
      base: 0,
      wallStart: performance.now(),
      lastFileTime: 0,
      frame: null,
      question: null,
      firstToken: null,
      turnId: 0,
      answer: null,
      silent: null,
      answering: false,
      framesSent: 0,
      framesProcessed: 0,
      skipped: 0,
      opened: false,
      created: false,
      ready: false,
      ended: false,
      timer: null,
    };
    session = s;
    lockSettings(true);
    $("hangup").disabled = false;
    setStatus("connecting");
    connect(s);
  }

  async function switchSource() {
    const kind = $("source").value;
    $("file").hidden = kind !== "file";
    const s = session;
    if (!s || s.ended || (kind === "file" && !$("file").files[0])) return;
    try {
      await openSource(kind);
      anchorClock(s, kind);
    } catch (error) {
      showError("source", error.message);
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    secureContextNote();
    $("start").addEventListener("click", start);
    $("hangup").addEventListener("click", () => session && abort(session));
    $("source").addEventListener("change", switchSource);
    $("file").addEventListener("change", switchSource);
    $("question").addEventListener("input", () => updateSendButton(session));
    $("ask").addEventListener("submit", (submit) => {
      submit.preventDefault();
      const s = session;
      if (!s || s.ended) return;
      const text = $("question").value.trim();
      if (!text) {
        // Stop: the protocol has no per-turn cancel, session.abort ends the session.
        if (s.answering) abort(s);
        return;
      }
      $("question").value = "";
      updateSendButton(s);
      const item = document.createElement("li");
      item.className = "question";
      item.textContent = text;
      $("turns").appendChild(item);
      s.question = text;
      sendQuestion(s, submit.timeStamp);
    });
  });
})();
