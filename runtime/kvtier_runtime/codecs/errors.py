"""The codecs' one error type, importable without torch (the layout descriptor raises it)."""


class CodecError(ValueError):
    """An encoded block or a codec argument broke a rule; the message names the field and the rule."""
