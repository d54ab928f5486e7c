from conftest import family_benchmark

FAMILY = "linalg"
test_linalg = family_benchmark(FAMILY)
