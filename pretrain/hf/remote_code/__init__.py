"""RopeLM for transformers: the files copied into every remote-code export (they import only
torch and transformers; the toolkit imports them too, to build and read RopeLM models)."""
