"""tieredkv."""
