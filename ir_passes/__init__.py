"""Graph → Graph rewrites, one per file. The order they run in lives in ``dflash_compiler.pipeline``."""
