package errtext

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

func TestErrorfNamesThePrefixOnce(t *testing.T) {
	t.Parallel()
	invalid, tooLarge := errors.New("pgoutbox: invalid message"), errors.New("pgoutbox: payload too large")
	err := Errorf("%w: %w: message %d", invalid, tooLarge, 3)
	require.Equal(t, "pgoutbox: invalid message: payload too large: message 3", err.Error())
	require.ErrorIs(t, err, invalid)
	require.ErrorIs(t, err, tooLarge)

	err = Errorf("pgoutbox: publish to %q: %w", "t", fmt.Errorf("%w (closed)", errors.New("pgoutbox: the transaction is done")))
	require.Equal(t, `pgoutbox: publish to "t": the transaction is done (closed)`, err.Error())

	plain := errors.New("connection refused")
	require.Equal(t, "pgoutbox: stats: connection refused", Errorf("pgoutbox: stats: %w", plain).Error())
	require.Equal(t, "no prefix: pgoutbox: x", Errorf("no prefix: %w", errors.New("pgoutbox: x")).Error())
	require.Equal(t, "stats: x", Trim(errors.New("pgoutbox: stats: x")))
}

func TestWithHintNamesPgBouncerForPreparedStatementErrors(t *testing.T) {
	t.Parallel()
	dup := &pgconn.PgError{Code: "42P05", Message: `prepared statement "stmtcache_1" already exists`}
	err := Errorf("pgoutbox: claim: %w", dup)
	require.ErrorIs(t, err, dup)
	require.Contains(t, err.Error(), "simple_protocol")
	require.Equal(t, err.Error(), WithHint(err).Error(), "named once")
	other := &pgconn.PgError{Code: "23505", Message: "duplicate key"}
	require.NotContains(t, Errorf("pgoutbox: publish: %w", other).Error(), "simple_protocol")
	require.NoError(t, WithHint(nil))
}

func TestWithHintNamesTheServersStatementTimeout(t *testing.T) {
	t.Parallel()
	server := &pgconn.PgError{Code: "57014", Message: "canceling statement due to statement timeout"}
	err := Errorf("pgoutbox: claim: %w", server)
	require.ErrorIs(t, err, server)
	require.Contains(t, err.Error(), "ALTER ROLE")
	client := &pgconn.PgError{Code: "57014", Message: "canceling statement due to user request"}
	require.NotContains(t, Errorf("pgoutbox: claim: %w", client).Error(), "ALTER ROLE", "the client's own bound")
	own := fmt.Errorf("%w (StatementTimeout 30ms)", server)
	require.NotContains(t, Errorf("pgoutbox: bind: %w", own).Error(), "ALTER ROLE", "a bound pgoutbox set on the server")
}

func TestWithHintNamesAReadOnlyServerAndALongIndexEntry(t *testing.T) {
	t.Parallel()
	ro := &pgconn.PgError{Code: "25006", Message: "cannot execute SELECT in a read-only transaction"}
	require.Contains(t, Errorf("pgoutbox: publish: %w", ro).Error(), "default_transaction_read_only")
	long := &pgconn.PgError{Code: "54000", Message: `index row size 3024 exceeds btree version 4 maximum 2704 for index "outbox_group_dedup_idx"`}
	require.Contains(t, Errorf("pgoutbox: bind: %w", long).Error(), "shorten them, or hash the key")
	other := &pgconn.PgError{Code: "54000", Message: "out of memory"}
	require.NotContains(t, Errorf("pgoutbox: bind: %w", other).Error(), "hash the key")
	denied := &pgconn.PgError{Code: "42501", Message: "permission denied for table outbox_paused"}
	require.Contains(t, WithHint(denied).Error(), "docs/upgrading.md", "a claim's log line says where the grants are")
	missing := &pgconn.PgError{Code: "42P01", Message: `relation "billing.outbox_bindings" does not exist`}
	require.Contains(t, Errorf("pgoutbox: stats: %w", missing).Error(), "pgoutbox schema apply", "the schema was never applied")
	users := &pgconn.PgError{Code: "42P01", Message: `relation "orders" does not exist`}
	require.NotContains(t, Errorf("pgoutbox: x: %w", users).Error(), "schema apply", "a name pgoutbox cannot tell for its own")
	older := &pgconn.PgError{Code: "42703", Message: `column "backlog_next" of relation "outbox_bindings" does not exist`}
	require.Contains(t, Errorf("pgoutbox: bind: %w", older).Error(), "schema migrate up")
}

func TestWithHintNamesByteaOutputAndLockTimeout(t *testing.T) {
	t.Parallel()
	scan := errors.New("can't scan into dest[2] (col: payload): invalid hex format")
	require.Contains(t, Errorf("pgoutbox: peek: %w", scan).Error(), "ALTER ROLE ... SET bytea_output = 'hex'")
	lock := &pgconn.PgError{Code: "55P03", Message: "canceling statement due to lock timeout"}
	require.Contains(t, Errorf("pgoutbox: publish: %w", lock).Error(), "notification lock")
	nowait := &pgconn.PgError{Code: "55P03", Message: `could not obtain lock on row in relation "outbox"`}
	require.NotContains(t, Errorf("pgoutbox: publish: %w", nowait).Error(), "notification lock")
	// A schema change's own bounded wait says what to do; the server's
	// lock_timeout is not what ended it.
	ddl := Errorf("pgoutbox: migrate: a table change waited longer than lock_timeout (5s) for a lock another transaction holds: %w", lock)
	require.NotContains(t, ddl.Error(), "the server's lock_timeout")
}

func TestNoAnswerNamesALockAndAPoolersQueue(t *testing.T) {
	t.Parallel()
	hint := NoAnswer(15 * time.Second)
	require.Contains(t, hint, "no answer within 15s: a session may hold or await an exclusive lock on the outbox")
	require.Contains(t, hint, "behind a connection pooler")
	require.Contains(t, hint, "SHOW POOLS")
}

// A statement whose bound ran out says what may hold it, once; one never
// sent, and other errors, get nothing more.
func TestWithNoAnswerNamesWhatMayHoldAStatement(t *testing.T) {
	t.Parallel()
	err := WithNoAnswer(fmt.Errorf("claim: %w", context.DeadlineExceeded))
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Contains(t, err.Error(), "claim: context deadline exceeded (no answer within StatementTimeout: a session may hold or await an exclusive lock on the outbox")
	require.Contains(t, err.Error(), "in session pooling each client connection keeps one")
	require.Equal(t, err.Error(), WithNoAnswer(err).Error(), "once")
	for _, other := range []error{
		fmt.Errorf("claim: context already done: %w", context.DeadlineExceeded),
		errors.New("claim: conn closed"),
		nil,
	} {
		require.Equal(t, other, WithNoAnswer(other))
	}
}
