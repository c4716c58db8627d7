"""Accounted collectives (ops.py); codecs and hierarchical reduction join them here."""
