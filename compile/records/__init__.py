"""Tuning databases, read side: what a record may contain (policy) and applying records."""
