package main

import "testing"

// The example runs against the PostgreSQL of POSTGRES_DSN (make test sets
// it) and fails unless exactly the committed orders were consumed and the
// rolled-back one left no row and no message.
func TestExample(t *testing.T) {
	if err := run(); err != nil {
		t.Fatal(err)
	}
}
