package pgoutbox

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// readCommitted makes the implicit transaction of a batch READ COMMITTED.
// The subscriber's claims and writes rely on it: a claim skips a row a
// competitor locked and re-reads one it changed, where REPEATABLE READ or
// SERIALIZABLE (a database's or role's default_transaction_isolation)
// fails the statement with a serialization error, and claims, acks and
// renewals were logged as failed and backed off under competition. A SET
// (not SET LOCAL, which warns outside a transaction block; not
// set_config, whose SELECT takes the snapshot first) applies to the
// transaction it runs in only: the next starts from the default again.
// It is queued only where the default is another (databaseFacts.isolate),
// so the common case pays no statement for it. The held claim opens its
// transaction with BEGIN ISOLATION LEVEL READ COMMITTED instead
// (claimer.held): keep the two in step.
const readCommitted = "SET transaction_isolation = 'read committed'"

// ownBatch starts a batch of the subscriber's own statements, which run in
// one implicit transaction: READ COMMITTED first where isolate is set, then
// the statements given. It returns the batch and how many results come
// before the caller's own statements.
func ownBatch(isolate bool, leading ...string) (*pgx.Batch, int) {
	b := &pgx.Batch{}
	if isolate {
		b.Queue(readCommitted)
	}
	for _, s := range leading {
		b.Queue(s)
	}
	return b, b.Len()
}

// skipResults reads the first n results of res, returning the first error.
func skipResults(res pgx.BatchResults, n int) error {
	for range n {
		if _, err := res.Exec(); err != nil {
			return err
		}
	}
	return nil
}

// execOwn runs one statement of the subscriber's own on pool, READ
// COMMITTED where isolate is set (see readCommitted).
func execOwn(ctx context.Context, pool *pgxpool.Pool, isolate bool, sql string, args ...any) error {
	if !isolate {
		_, err := pool.Exec(ctx, sql, args...)
		return err
	}
	b, lead := ownBatch(true)
	b.Queue(sql, args...)
	res := pool.SendBatch(ctx, b)
	err := skipResults(res, lead+1)
	if cerr := res.Close(); err == nil {
		err = cerr
	}
	return err
}
