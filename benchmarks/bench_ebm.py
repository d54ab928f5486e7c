from conftest import family_benchmark

FAMILY = "ebm"
test_ebm = family_benchmark(FAMILY)
