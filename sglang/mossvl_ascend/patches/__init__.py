"""The plugin's changes to stock sglang, one module per patched sglang area.

Each module declares ``PATCHES`` (and optionally ``VERIFIED``) records and no module registers a hook itself:
:func:`mossvl_ascend.registry.apply_patches` applies them in :data:`mossvl_ascend.patch_record.PATCH_MODULES` order.
"""
