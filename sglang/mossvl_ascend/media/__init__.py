"""A request's media under the operator's control: which local files and URLs a client may make the server read
(``access``), and how a request asks for a video's frames (``sampling``)."""
