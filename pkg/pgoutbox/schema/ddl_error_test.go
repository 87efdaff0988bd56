package schema

import (
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// A refusal a schema statement raises itself (RAISE EXCEPTION, P0001: the
// conversion's check that its arrivals table is empty, under the table's
// lock) says what to do; the statement after it, a DO block, was ten lines
// of SQL that said nothing more. Other failures keep their statement.
func TestDDLErrorLeavesOutTheStatementOfItsOwnRefusal(t *testing.T) {
	t.Parallel()
	refusal := &pgconn.PgError{Code: "P0001", Message: `"s"."outbox_arrivals" holds arrivals`}
	err := lockWait{timeout: "5s"}.ddlError("DO $pgoutbox$ BEGIN ... END $pgoutbox$", refusal)
	require.True(t, errors.Is(err, refusal))
	require.NotContains(t, err.Error(), "statement:")
	require.NotContains(t, err.Error(), "DO $pgoutbox$")

	other := &pgconn.PgError{Code: "42P07", Message: "relation already exists"}
	err = lockWait{timeout: "5s"}.ddlError("CREATE TABLE s.t ()", other)
	require.ErrorContains(t, err, "statement: CREATE TABLE s.t ()")
}
