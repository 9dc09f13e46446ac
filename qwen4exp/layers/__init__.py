"""One module per mechanism: pure math on packed tokens. States are passed in and returned, never owned."""
