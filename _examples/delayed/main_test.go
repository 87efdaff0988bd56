package main

import "testing"

// The example runs against the PostgreSQL of POSTGRES_DSN (make test sets
// it) and fails if a message arrived early, out of order, or despite its
// cancellation.
func TestExample(t *testing.T) {
	if err := run(); err != nil {
		t.Fatal(err)
	}
}
