"""Batched matrix inverse p-th roots and Kronecker-factored preconditioning."""
