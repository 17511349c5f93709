"""Restore: one chooser over the tiers (each answers tier.py's interface) takes the
newest verified step from its fastest holder, and the restorer hands it over."""
