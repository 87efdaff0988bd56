package pgoutbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

// The claimer's held claim (claimer.go has the lease claim): its
// statements, on a connection the held batch keeps until it ends.

// held opens a held transaction and locks up to req.n ready rows
// in it. A transaction that locked nothing ends at once.
func (c *claimer) held(req claimRequest) claimResult {
	r := claimResult{req: req}
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.StatementTimeout)
	defer cancel()
	conn, err := acquire(ctx, c.pool)
	if err != nil {
		r.err = err
		return r
	}
	b := &pgx.Batch{}
	// READ COMMITTED whatever the database's default: each statement of
	// the batch must see what committed before it (the key checks look
	// again with a newer snapshot), and one row a competitor changed must
	// be skipped or read anew, not fail the batch (REPEATABLE READ).
	b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
	if !c.cfg.SynchronousCommit {
		b.Queue("SET LOCAL synchronous_commit = off") // see SubscriberConfig.SynchronousCommit
	}
	// If this process stalls or its network vanishes while the batch is
	// held, the server ends the transaction after this long, and the rows
	// are due again: the held path's bound on how long rows stay locked,
	// where the lease path has Lease.
	b.Queue(fmt.Sprintf("SET LOCAL idle_in_transaction_session_timeout = %d", heldIdleTimeout(c.cfg).Milliseconds()))
	b.Queue(query.ClaimSettings)
	b.Queue(c.q.HeldClaim, c.q.Held(query.HeldArgs{Topic: c.topic, Group: c.cfg.ConsumerGroup, N: req.n,
		CursorAt: req.from.at, CursorID: req.from.id, Arrivals: req.arrivals.after})...)
	res := conn.SendBatch(ctx, b)
	err = func() error {
		defer res.Close()
		for range b.Len() - 1 {
			if _, err := res.Exec(); err != nil {
				return err
			}
		}
		rows, err := res.Query()
		if err != nil {
			return err
		}
		var id pgtype.Int8 // outside the loop, and their list too: see lease
		var uuid, key pgtype.Text
		var payload, metaRaw []byte
		var deliveries pgtype.Int4
		var availableAt, createdAt pgtype.Timestamptz
		var arrival pgtype.TID
		var shared pgtype.Bool
		dest := []any{&id, &uuid, &payload, &metaRaw, &deliveries, &availableAt, &key, &createdAt}
		if c.q.Names.Arrivals {
			// Whether each row is an arrival; a last row of NULLs says
			// whether arrivals of other groups wait.
			dest = append(dest, &arrival, &shared)
		}
		var slab deliverySlab
		for rows.Next() {
			if err := rows.Scan(dest...); err != nil {
				rows.Close()
				return err
			}
			if !id.Valid {
				r.arrivals.waiting = shared.Bool
				continue
			}
			d := slab.next()
			d.token, d.id, d.payload, d.metaRaw, d.availableAt = req.token, id.Int64, payload, metaRaw, availableAt.Time
			d.uuid, d.deliveries, d.orderingKey, d.createdAt = uuid.String, int(deliveries.Int32), key.String, createdAt.Time.UnixMicro()
			d.arrival = arrival
			if d.arrival.Valid {
				r.arrivals.last = max(r.arrivals.last, d.id)
			}
			r.rows = append(r.rows, d)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		// Keyed rows: lock their keys, then look again with a newer
		// snapshot (query.KeyLockHeld, KeyVerifyHeld), in one round trip.
		// Rows left out stay locked, unhandled, until the batch ends.
		if ids := keyedIDs(r.rows); ids != nil {
			res.Close() // the batch's results are read: the connection is free
			kb := &pgx.Batch{}
			kb.Queue(c.q.KeyLockHeld, c.topic, ids, c.cfg.ConsumerGroup)
			kb.Queue(c.q.KeyVerifyHeld, c.topic, ids, c.cfg.ConsumerGroup)
			kr := conn.SendBatch(ctx, kb)
			defer kr.Close()
			taken, err := collectIDs(kr.Query())
			if err != nil {
				return err
			}
			busy, err := collectIDs(kr.Query())
			if err != nil {
				return err
			}
			for id := range taken {
				busy[id] = true
			}
			r.rows, r.keyBusy = dropIDs(r.rows, busy), len(busy)
		}
		return nil
	}()
	if err != nil {
		// A connection left inside a transaction is not reused: the pool
		// closes it, and the server rolls the transaction back.
		conn.Release()
		r.rows, r.err = nil, err
		return r
	}
	if len(r.rows) == 0 {
		r.took = time.Since(req.sent)
		if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
			conn.Conn().Close(ctx) //nolint:errcheck // closing is the way out
		} else {
			r.dueIn = c.nextDue(conn)
		}
		conn.Release()
		return r
	}
	// ORDER BY with FOR UPDATE may return a row out of order when it was
	// changed while the claim waited for it (READ COMMITTED re-reads it).
	sortQueueOrder(r.rows)
	// The cursor is the last outbox row's: arrivals have their own (r.arrivals.last).
	for i := len(r.rows) - 1; i >= 0; i-- {
		if last := r.rows[i]; !last.arrival.Valid {
			r.last = scanEnd{at: pgtype.Timestamptz{Time: last.availableAt, Valid: true}, id: pgtype.Int8{Int64: last.id, Valid: true}}
			break
		}
	}
	r.free = len(r.rows)
	r.batch = &heldBatch{conn: conn, token: req.token, rows: r.rows, undecided: len(r.rows)}
	r.took = time.Since(req.sent)
	return r
}

// heldIdleTimeout is idle_in_transaction_session_timeout for held
// transactions: the bound, plus time for the owner to end the batch.
func heldIdleTimeout(cfg *SubscriberConfig) time.Duration {
	return heldBoundOf(cfg) + cfg.StatementTimeout
}
