"""Input pipeline: grain sources, image/text transforms, tokenizers, demo data."""
