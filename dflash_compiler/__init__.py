"""dflash-compiler: compile DFlash-family speculative-decoding drafters into CUDA artifacts."""

__version__ = "0.1.0"
