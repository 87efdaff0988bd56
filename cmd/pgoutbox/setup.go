package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// parseNoArgs parses args for a command that takes no positional
// arguments.
func (cmd *command) parseNoArgs(args []string) error {
	pos, err := cmd.parse(args)
	if err != nil {
		return err
	}
	return cmd.noArgs(pos)
}

// required fails when the flag --name was not given a value.
func (cmd *command) required(name, value string) error {
	if value == "" {
		return usagef(cmd.name, "--%s is required", name)
	}
	return nil
}

// limitInRange fails when --limit is outside 1..max.
func (cmd *command) limitInRange(limit, max int) error {
	if limit < 1 || limit > max {
		return usagef(cmd.name, "--limit %d is out of range; use 1 to %d", limit, max)
	}
	return nil
}

// withOutbox resolves the tables from the flags, runs before (when not
// nil: a confirmation, say) ahead of connecting, connects and calls fn
// with the connection and the tables. The pool is closed when fn returns.
// Ctrl-C (or SIGTERM) cancels fn's context: the statement under way is
// cancelled on the server too, where killing the process would leave it
// running (an index build of a conversion, a migration waiting for a lock).
func (cmd *command) withOutbox(parent context.Context, before func() error,
	fn func(ctx context.Context, exec tx.Executor, tables schema.Config) error) error {
	tables, err := cmd.tables()
	if err != nil {
		return err
	}
	if before != nil {
		if err := before(); err != nil {
			return err
		}
	}
	// After before: Ctrl-C at a confirmation's prompt ends the process.
	ctx, stop := signal.NotifyContext(parent, os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, exec, err := cmd.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if cmd.inspects {
		var cancel context.CancelFunc
		ctx, cancel = reading(ctx)
		defer cancel()
	}
	if tables, err = cmd.layout(ctx, exec, tables); err != nil {
		return readTimedOut(ctx, err)
	}
	if err := fn(ctx, exec, tables); err != nil {
		if timedOut := readTimedOut(ctx, err); timedOut != err {
			return timedOut
		}
		if ctx.Err() != nil && parent.Err() == nil {
			return fmt.Errorf("interrupted: the statement under way was cancelled on the server too; what committed before it stays, and the command can be run again: %w", err)
		}
		return missingDLQ(ctx, exec, tables, err)
	}
	return nil
}

// readTimeout bounds what an inspecting command reads (cmd.inspects, and
// each redraw of stats --watch): behind an exclusive lock on the outbox (a
// VACUUM FULL, an ALTER TABLE, a migration, or one of them waiting for
// its lock) it waited without a word for as long as the lock was held.
const readTimeout = 15 * time.Second

// reading bounds ctx by readTimeout.
func reading(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, readTimeout)
}

// readTimedOut is err with what to do when ctx, a reading bound, ran out;
// any other error as it is.
func readTimedOut(ctx context.Context, err error) error {
	if err == nil || !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return err
	}
	return &hintedError{err: err, hint: errtext.NoAnswer(readTimeout)}
}

// missingDLQ explains an error of a missing table when the table missing
// is the dead-letter table of an outbox that exists: such an outbox was
// likely made without one (--no-dlq), which "schema apply" would change.
// Any other error is returned as it is.
func missingDLQ(ctx context.Context, exec tx.Executor, tables schema.Config, err error) error {
	var pgErr *pgconn.PgError
	if tables.NoDeadLetterTable || !errors.As(err, &pgErr) || pgErr.Code != undefinedTable {
		return err
	}
	t := tables.WithDefaults()
	n, nerr := query.NewNames(t.Schema, t.Table, t.DeadLetterTable)
	if nerr != nil {
		return err
	}
	var outbox, dlq bool
	if queryValue(ctx, exec, &outbox, query.TableExists, n.QTable) != nil ||
		queryValue(ctx, exec, &dlq, query.TableExists, n.QDLQ) != nil || !outbox || dlq {
		return err
	}
	return &hintedError{err: err, hint: fmt.Sprintf("; the outbox %s.%s has no dead-letter table %s.%s: if it was made without one, pass --no-dlq "+
		"(or set PGOUTBOX_NO_DLQ=true); to give it one, run \"pgoutbox schema apply\" (or name the table it has with --dlq-table)",
		t.Schema, t.Table, t.Schema, t.DeadLetterTable)}
}

// layout sets tables.Rotating from the database when the outbox exists
// and --rotating was not given: an operator should not have to know how
// the outbox was made. A --rotating that contradicts the database is a
// usage error.
func (cmd *command) layout(ctx context.Context, exec tx.Executor, tables schema.Config) (schema.Config, error) {
	t := tables.WithDefaults()
	var kind string
	if err := queryValue(ctx, exec, &kind, query.CatalogRotating, t.Schema, t.Table); err != nil || kind == "" {
		return tables, err // no outbox yet: the flag says what to make
	}
	rotating := kind == "rotating"
	if cmd.rotating.set && cmd.rotating.value != rotating {
		if rotating {
			return tables, usagef(cmd.name, "%s.%s is a rotating outbox; drop --rotating=false (or $PGOUTBOX_ROTATING)", t.Schema, t.Table)
		}
		return tables, usagef(cmd.name, "%s.%s is a single table, not a rotating outbox; drop --rotating (or $PGOUTBOX_ROTATING), or convert it with pgoutbox schema convert-to-rotating", t.Schema, t.Table)
	}
	tables.Rotating = rotating
	if !rotating && !tables.Arrivals {
		// Every single table has an arrivals table (schema version 7): the
		// commands take the arrivals' paths (a binding's start, the
		// settling at an unbind or a move) where the role may, as the
		// subscribers of an outbox with arrivals must; a role granted what
		// an outbox without them needs goes on as before, and Stats and
		// Peek read the arrivals wherever the role may read them.
		n, err := query.NewNames(t.Schema, t.Table, "")
		if err != nil {
			return tables, err
		}
		if err := queryValue(ctx, exec, &tables.Arrivals, query.ArrivalsUsable, n.WithArrivals().QArrivals, n.QTable); err != nil {
			return tables, err
		}
	}
	return tables, nil
}

// queryValue scans the one column of q's last row into dest, which stays
// as it was when q returns no row.
func queryValue(ctx context.Context, exec tx.Executor, dest any, q string, args ...any) error {
	rows, err := exec.Query(ctx, q, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := rows.Scan(dest); err != nil {
			return err
		}
	}
	return rows.Err()
}
