"""Tiny randomly initialised Diffusers models and pipelines, built in code (nothing downloaded).

They are the examples' embedded defaults (``bash scripts/main.sh`` runs ``tiny_flux``) and the
tests' fixtures: apart from the Diffusers integration (``usp_dit.pipelines``), which never imports
them. Layout: each module documents its models' inputs.
"""
