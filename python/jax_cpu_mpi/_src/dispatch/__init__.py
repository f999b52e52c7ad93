"""jit's C++ dispatch for psend/precv programs, and the device-thread hint it needs."""
