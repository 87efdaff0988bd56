package main

import "testing"

// The example runs against the PostgreSQL of POSTGRES_DSN (make test sets
// it) and fails unless one message succeeded after its retries and the
// other reached the poison topic.
func TestExample(t *testing.T) {
	if err := run(); err != nil {
		t.Fatal(err)
	}
}
