from conftest import family_benchmark

FAMILY = "primitives"
test_primitives = family_benchmark(FAMILY)
