package pgoutbox_test

import (
	"os"
	"testing"

	"github.com/pgoutbox/watermill-pgoutbox/internal/pgtest"
)

// TestMain fails the run if a test or the example left a schema behind. The
// example makes its schema outside pgtest, in POSTGRES_DSN's own database,
// so it is checked by its exact name.
func TestMain(m *testing.M) {
	code := pgtest.CheckNoLeftoverSchemas(m)
	os.Exit(pgtest.CheckSchemasGone(code, pgtest.AdminDSN(), exampleSchema, false))
}
