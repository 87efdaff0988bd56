// Package errtext builds error texts that name "pgoutbox:" once, however
// many pgoutbox errors they wrap.
package errtext

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/puddle/v2"
)

// Prefix begins every pgoutbox error text.
const Prefix = "pgoutbox: "

// Errorf is fmt.Errorf (errors.Is and errors.As see every %w) whose text
// drops the Prefix of each wrapped error after the first one:
// "pgoutbox: invalid message: payload too large: …", not "pgoutbox: invalid
// message: pgoutbox: payload too large: …".
func Errorf(format string, args ...any) error {
	err := WithHint(fmt.Errorf(format, args...))
	msg := err.Error()
	start := strings.Index(msg, Prefix)
	if start < 0 {
		return err
	}
	head, tail := msg[:start+len(Prefix)], msg[start+len(Prefix):]
	if !strings.Contains(tail, ": "+Prefix) {
		return err
	}
	return &wrapped{msg: head + strings.ReplaceAll(tail, ": "+Prefix, ": "), err: err}
}

// Trim returns err's text without its Prefix, for a caller that prints its
// own (the CLI).
func Trim(err error) string { return strings.TrimPrefix(err.Error(), Prefix) }

type wrapped struct {
	msg string
	err error
}

func (w *wrapped) Error() string { return w.msg }

// Unwrap returns what fmt.Errorf built, whose own Unwrap gives the wrapped
// errors.
func (w *wrapped) Unwrap() error { return w.err }

// pgbouncerHint is what a prepared statement the server does not know, or
// knows already, means: a pooler in transaction mode handed the session's
// statements to another client.
const pgbouncerHint = " (behind PgBouncer in transaction pooling mode, set default_query_exec_mode=simple_protocol in the DSN: docs/operations.md#pgbouncer)"

// WithHint returns err with the likely cause appended when it is a server
// error whose message alone would not tell it: a prepared statement that
// does not exist (26000) or exists already (42P05), a statement the
// server's statement_timeout cancelled (57014), a read-only server or role
// (25006), an index entry too long (54000), a closed pgxpool.Pool. Other errors, and nil, come
// back as they are.
func WithHint(err error) error {
	h := Hint(err)
	if h == "" || strings.Contains(err.Error(), h) {
		return err
	}
	return &wrapped{msg: err.Error() + h, err: err}
}

// noArrivalsHint is what a statement that names the arrivals table means
// when the outbox has none: a process whose Tables set Arrivals met an
// outbox converted to rotating, or migrated below version 7, after it
// started.
const noArrivalsHint = " (the outbox has no arrivals table: a rotating outbox has none, nor one migrated below schema version 7; this process's Tables set Arrivals: unset it and restart the process, whose messages wait in the outbox meanwhile)"

// statementTimeoutHint is what a statement the server cancelled for its
// statement_timeout means for pgoutbox, whose own bounds are client-side
// (StatementTimeout): a setting of the role or database below them won.
const statementTimeoutHint = " (the server's statement_timeout ended it: a role or database setting below the subscriber's StatementTimeout wins; raise it for this role, e.g. ALTER ROLE ... SET statement_timeout, and reconnect)"

// Hint is what WithHint appends to err, or "".
func Hint(err error) string {
	switch code := SQLState(err); {
	case code == "26000" || code == "42P05":
		return pgbouncerHint
	case code == "57014" && strings.Contains(err.Error(), "statement timeout") && !strings.Contains(err.Error(), "StatementTimeout"):
		// Not "canceling statement due to user request": the client's own
		// bound (a context) cancels with that. Nor a statement pgoutbox
		// bounded on the server itself: its error names StatementTimeout.
		return statementTimeoutHint
	case code == "25006":
		return readOnlyHint
	case code == "" && err != nil && strings.Contains(err.Error(), "invalid PostgreSQL date/time value"):
		return dateStyleHint
	case code == "" && err != nil && strings.Contains(err.Error(), "invalid hex format"):
		return byteaOutputHint
	case code == "55P03" && strings.Contains(err.Error(), "lock timeout") && !strings.Contains(err.Error(), "a table change waited longer than lock_timeout"):
		// Not a schema change's own bounded wait: its error says what to do.
		return lockTimeoutHint
	case code == "54000" && strings.Contains(err.Error(), "index row size"):
		return indexRowHint
	case code == "42501" && strings.Contains(err.Error(), "permission denied"):
		return privilegeHint
	case code == "42703" && !strings.Contains(err.Error(), "migrate up") && !strings.Contains(err.Error(), "not an outbox"):
		return olderSchemaHint
	case code == "42P01" && strings.Contains(err.Error(), `_arrivals" does not exist`):
		return noArrivalsHint
	case code == "42P01" && (strings.Contains(err.Error(), `_bindings" does not exist`) || strings.Contains(err.Error(), `_paused" does not exist`)) &&
		!strings.Contains(err.Error(), "schema apply"):
		return missingTablesHint
	case code == "" && errors.Is(err, puddle.ErrClosedPool):
		return closedPoolHint
	}
	return ""
}

// NoAnswer is what an operator's read that got no answer within d may
// mean: statements queue behind an exclusive lock on the outbox, or, behind
// a connection pooler, for a server connection (all busy, or the pool
// paused), which looks the same from here.
func NoAnswer(d time.Duration) string {
	return fmt.Sprintf("; no answer within %s: %s", d, noAnswerCauses)
}

// noAnswerCauses is what holds a statement that gets no answer, most
// often: a lock, or a pooler's queue.
const noAnswerCauses = "a session may hold or await an exclusive lock on the outbox (a VACUUM FULL, an ALTER TABLE, " +
	"a migration), which claims and publishes wait for too: pgoutbox health says which table and how to find the session; " +
	"behind a connection pooler, its server connections may all be busy, or the pool paused (PgBouncer: SHOW POOLS, cl_waiting)"

// WithNoAnswer returns err, an error of a statement of the subscriber's
// own, with what may have held it when it got no answer within its
// StatementTimeout: "context deadline exceeded" alone sent operators to
// the network while a migration's lock or a pooler's queue held the
// statement. Other errors, and nil, come back as they are. Only for
// statements bounded by StatementTimeout: a caller's deadline may have
// run out for reasons of its own.
func WithNoAnswer(err error) error {
	if err == nil || !errors.Is(err, context.DeadlineExceeded) || strings.Contains(err.Error(), noAnswerHint) ||
		strings.Contains(err.Error(), "context already done") { // never sent: nothing held it
		return err
	}
	return &wrapped{msg: err.Error() + noAnswerHint, err: err}
}

const noAnswerHint = " (no answer within StatementTimeout: " + noAnswerCauses +
	"; in session pooling each client connection keeps one for its life; or the server, or the network path to it, does not answer)"

// missingTablesHint is what a missing table of the outbox's own (bindings,
// paused groups) means: the tables were never created in this schema, the
// names point elsewhere, or the outbox predates that table. (The outbox and
// dead-letter tables are named by the user: the functions that read them
// say what their absence means.)
const missingTablesHint = ` (a table of the outbox is missing: run "pgoutbox schema apply" to create the tables (schema.Create in code), or "pgoutbox schema migrate up" (schema.Migrate) to bring an outbox of an earlier version up to date; check the schema and table names too: schema.Config's Schema and Table, the CLI's --schema and --table)`

// closedPoolHint is what pgxpool's bare "closed pool" means to whoever
// gave the pool to a Subscriber or Publisher.
const closedPoolHint = " (the pgxpool.Pool given to pgoutbox was closed: close the Subscribers and Publishers of a pool, or end their contexts, before closing it, and give new ones an open pool)"

// olderSchemaHint is what a column pgoutbox names but the outbox lacks
// means: the library was upgraded before the outbox's migration ran.
const olderSchemaHint = " (the outbox lacks a column of this library's schema: it is of an earlier version; run `pgoutbox schema migrate up` or schema.Migrate (docs/upgrading.md), `pgoutbox schema migrate status` tells its version)"

// privilegeHint is what a missing grant means: most often a table a schema
// upgrade added (the paused groups of version 5, read by every claim) that
// the application's roles were never granted.
const privilegeHint = " (the role lacks a privilege on it: grant what docs/operations.md (Least privilege) lists for this role; after a schema upgrade, the grants its version needs, docs/upgrading.md)"

// readOnlyHint is what "cannot execute ... in a read-only transaction"
// means where pgoutbox writes: "SELECT" in it (a statement that writes
// through a CTE) sent people looking at the query.
const readOnlyHint = " (the statement ran read-only: in a READ ONLY transaction of yours, or default_transaction_read_only is on for this role or database, or the connection reached a standby; connect to the primary, or ALTER ROLE ... SET default_transaction_read_only = off, and reconnect)"

// byteaOutputHint is what a payload pgx cannot read means: through the
// simple protocol (behind PgBouncer) bytea comes as text in the session's
// bytea_output, and pgx reads hex only.
const byteaOutputHint = " (through the simple protocol binary data comes as text in the session's bytea_output, which must be hex: ALTER ROLE ... SET bytea_output = 'hex' and reconnect, or, not behind PgBouncer (which refuses it as a startup parameter), set bytea_output=hex in the DSN)"

// lockTimeoutHint is what a lock wait the server ended means: pgoutbox
// bounds its own waits, so a role's or database's lock_timeout below them
// won: behind another session's lock on the outbox (a migration), or, at
// the COMMIT of a transaction that published, the database's notification
// lock, which every committing publisher takes in turn.
const lockTimeoutHint = " (the server's lock_timeout, a role or database setting, ended a lock wait: another session held a lock on the outbox (an ALTER TABLE, a VACUUM FULL, a LOCK of a migration: `pgoutbox health` names a table so locked), " +
	"or, at the COMMIT of a transaction that published, the database's notification lock, which committing publishers take one after the other; " +
	"nothing of the failed transaction was kept: retry, and raise lock_timeout for this role, or SET LOCAL lock_timeout in such transactions, if the waits are expected)"

// dateStyleHint is what a timestamp pgx cannot read means: through the
// simple protocol (behind PgBouncer) it comes as text in the session's
// DateStyle, and pgx reads ISO only.
const dateStyleHint = " (through the simple protocol timestamps come as text in the session's DateStyle, which must be ISO: set DateStyle=ISO in the DSN, or ALTER ROLE ... SET DateStyle = 'ISO', and reconnect)"

// indexRowHint is what an index entry over PostgreSQL's limit means for
// the outbox: a topic, consumer group and dedup or ordering key share one.
const indexRowHint = " (a topic, consumer group and dedup or ordering key are stored in one index entry, which PostgreSQL limits to 2,704 bytes: shorten them, or hash the key)"

// SQLState returns the SQLSTATE of the server error err wraps, from any
// driver whose errors report it (pgx's *pgconn.PgError, lib/pq's
// *pq.Error, or by the protocol's field code 'C' as bun's pgdriver.Error),
// or "" for any other error and nil.
func SQLState(err error) string {
	var withState interface{ SQLState() string }
	if err != nil && errors.As(err, &withState) {
		return withState.SQLState()
	}
	var withFields interface{ Field(byte) string }
	if err != nil && errors.As(err, &withFields) {
		return withFields.Field('C')
	}
	return ""
}

// MinDuration is the least positive duration a setting takes
// (pgoutbox.MinDuration): a value under it is a number of nanoseconds given
// where seconds or milliseconds were meant ("AckDeadline: 30").
const MinDuration = time.Millisecond

// TooShort explains setting name's positive value d under MinDuration,
// or returns "".
func TooShort(name string, d time.Duration) string {
	if d <= 0 || d >= MinDuration {
		return ""
	}
	return fmt.Sprintf("%s is %s; it must be at least %s (a bare number is nanoseconds: write %d * time.Second or %d * time.Millisecond)",
		name, d, MinDuration, int64(d), int64(d))
}
