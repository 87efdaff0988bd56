package main

import "testing"

// The demo runs against the PostgreSQL of POSTGRES_DSN (make test sets
// it) and fails unless the committed order's message was handled and
// acked, and the rolled-back order left no message.
func TestExample(t *testing.T) {
	if err := run(); err != nil {
		t.Fatal(err)
	}
}
