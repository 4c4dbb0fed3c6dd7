"""Ling-VL: the vision config, the vision tower, image preprocessing, the VL model and its prompts."""
