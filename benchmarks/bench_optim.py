from conftest import family_benchmark

FAMILY = "optim"
test_optim = family_benchmark(FAMILY)
