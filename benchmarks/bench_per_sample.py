from conftest import family_benchmark

FAMILY = "per_sample"
test_per_sample = family_benchmark(FAMILY)
