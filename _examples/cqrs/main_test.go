package main

import "testing"

// The example runs against the PostgreSQL of POSTGRES_DSN (make test sets
// it) and fails unless every event handler saw every event.
func TestExample(t *testing.T) {
	if err := run(); err != nil {
		t.Fatal(err)
	}
}
