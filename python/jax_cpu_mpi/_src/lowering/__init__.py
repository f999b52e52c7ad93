"""CPU lowerings of psend/precv, their routing tables, optimization barriers over tokens."""
