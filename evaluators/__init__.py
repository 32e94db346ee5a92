"""Evaluators: zero-shot classification, retrieval, uncertainty analyses, prompt re-weighting."""
