"""Second-order optimizers: Shampoo and K-FAC."""
