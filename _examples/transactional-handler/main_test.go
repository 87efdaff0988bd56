package main

import "testing"

// The example runs against the PostgreSQL of POSTGRES_DSN (make test sets
// it) and fails unless each deposit changed its balance once and produced
// one output message, the failed attempt's write rolled back.
func TestExample(t *testing.T) {
	if err := run(); err != nil {
		t.Fatal(err)
	}
}
