package main

import "testing"

// The example runs against the PostgreSQL of POSTGRES_DSN (make test sets
// it) and fails unless each layer of the stack did its part: the panic was
// retried in a new transaction, the failing order poisoned with its write
// undone, the rejected one dead-lettered with its error, and the output
// kept the correlation id.
func TestExample(t *testing.T) {
	if err := run(); err != nil {
		t.Fatal(err)
	}
}
