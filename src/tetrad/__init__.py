"""tetrad: train decoder-only transformers with 4D parallelism, and let a cost model pick the layout."""

__version__ = "0.1.0"
