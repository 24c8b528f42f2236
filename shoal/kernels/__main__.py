"""`python -m shoal.kernels`: build the native kernels now (`make setup` does) and say which instruction set they use."""

import logging

from shoal.kernels import available, isa, library_path

logging.basicConfig(level=logging.INFO, format="%(message)s")
print(f"shoal native kernels: {'built, ' + isa() if available() else 'not available'} ({library_path()})")
