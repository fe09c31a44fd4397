"""Plumbing shared by the posttrain scripts: Ray placement, vLLM engines, weight sync, data, runs.

The algorithms live in the top-level scripts; nothing here contains training math.
"""
