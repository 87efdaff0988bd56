package pgoutbox_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// TestMain fails the run if a test or the example left a schema behind. The
// example makes its schema outside pgoutboxtest, in POSTGRES_DSN's own
// database, so it is checked by its exact name.
func TestMain(m *testing.M) {
	code := pgoutboxtest.Run(m)
	if code == 0 && exampleSchemaLeft() {
		code = 1
	}
	os.Exit(code)
}

// exampleSchemaLeft reports whether the example's schema is still there.
// A server the example could not reach holds nothing of it.
func exampleSchemaLeft() bool {
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = pgoutboxtest.LocalDSN
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return false
	}
	defer conn.Close(ctx)
	var left bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, exampleSchema).Scan(&left); err != nil || !left {
		return false
	}
	fmt.Fprintf(os.Stderr, "FAIL: the example left its schema %s behind\n", exampleSchema)
	return true
}
