"""Plumbing shared by the posttrain scripts; the algorithms (all training math) live in them."""
