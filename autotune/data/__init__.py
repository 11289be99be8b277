"""Text the project trains and benchmarks on: `corpus` reads the sources (the standard library,
and ../shared/corpora where present), `classes` builds request classes and mixed workloads."""
