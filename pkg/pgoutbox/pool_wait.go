package pgoutbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
)

// acquire takes a connection of pool for a statement of the subscriber's
// own. When none comes free before ctx ends, the error says that it was
// the pool, not the database, that made it wait: "context deadline
// exceeded" alone sent operators to look at the server while handlers
// held every connection.
func acquire(ctx context.Context, pool *pgxpool.Pool) (*pgxpool.Conn, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil && errors.Is(err, context.DeadlineExceeded) {
		return nil, poolWaitError(pool, err)
	}
	return conn, err
}

// poolWaitError is err, a wait for a connection of pool that ran out of
// time, with what made it wait: the pool's connections all in use, or,
// with room left, a new connection that was not made in time (the server
// or the network does not answer: the pool's full-pool advice misled
// there).
func poolWaitError(pool *pgxpool.Pool, err error) error {
	st := pool.Stat()
	// Read after the wait failed: a connection released since may leave
	// room in a pool that was full; one being made is what it waited for.
	if st.AcquiredConns() < st.MaxConns() && st.ConstructingConns() > 0 {
		return &poolWait{fmt.Errorf("no connection of the subscriber's pool in time: a new connection to the database was not made "+
			"(%d of %d in use, %d being made) within the statement's bound; the server or the network path to it does not answer new connections, "+
			"or making one takes longer than StatementTimeout: %w",
			st.AcquiredConns(), st.MaxConns(), st.ConstructingConns(), err)}
	}
	if st.AcquiredConns() < st.MaxConns() && st.IdleConns() == 0 {
		// Room, and no connection being made any more: the wait ended
		// while one was set up (a StatementTimeout shorter than the
		// connection takes, a slow TLS handshake or server).
		return &poolWait{fmt.Errorf("no connection of the subscriber's pool in time, with room in it (%d of %d in use): "+
			"making a new connection to the database took longer than the statement's bound (StatementTimeout); raise StatementTimeout, "+
			"or find what slows new connections (TLS, authentication, a distant or busy server): %w", st.AcquiredConns(), st.MaxConns(), err)}
	}
	return &poolWait{fmt.Errorf("no connection of the subscriber's pool came free in time (%d of %d in use): "+
		"handlers holding connections (tx.Middleware, queries of your own) can take them all, and so can the subscriber's own "+
		"statements while they wait on the server (a lock on the outbox, a server not answering); for the first, "+
		"give the pool MaxInFlight plus two connections, or the subscriber a pool of its own (docs/operations.md, Pool sizing): %w",
		st.AcquiredConns(), st.MaxConns(), err)}
}

// poolWait is the error of a wait for a pool connection that ran out of
// time: told apart from a statement's own deadline, which may be a
// half-open connection's (Subscribe retries that one).
type poolWait struct{ err error }

func (p *poolWait) Error() string { return p.err.Error() }
func (p *poolWait) Unwrap() error { return p.err }
