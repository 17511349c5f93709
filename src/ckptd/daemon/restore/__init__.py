"""Restore: choose the newest verified copy, fetch it from the bucket if need be, hand it over."""
