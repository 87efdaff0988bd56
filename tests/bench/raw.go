package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// rawSystem is the floor: the lease pattern written by hand with pgx, on
// pgoutbox's own table, with nothing else. Publishing is one INSERT ...
// FROM unnest (plus the NOTIFY pgoutbox also sends, in the same statement);
// consuming is one loop on one connection that claims up to 100 rows with
// pgoutbox's claim statement and acks them all with one DELETE under the
// lease token, both committing asynchronously as pgoutbox's subscriber does
// by default (-sync-commit: both wait). No router, no channels, no
// per-message goroutines, no renewal, no retry bookkeeping: what pgoutbox
// costs above this is the price of its features and of Watermill's delivery
// model. It is a sequential loop, though: pgoutbox overlaps its claims with
// its ack writes, so it can beat this floor.
//
// Two variants: "raw" is the plain pattern with the server's default
// durability (every claim and ack waits for its WAL flush), the floor a
// hand-written consumer gets; "raw-async" adds pgoutbox's own
// asynchronous-commit condition to its claim and ack, the floor for the
// same durability trade pgoutbox makes by default.
// rawSystem is the hand-written floor. insertOnly makes "raw-insert": the
// same, but its publish is a bare INSERT without NOTIFY (the floor of the
// concurrent publish scenarios, which only it takes part in).
type rawSystem struct{ async, insertOnly, held bool }

const rawInsertName = "raw-insert"

// rawHeldName is the held-transaction ceiling (issue "fast path"): each
// batch is deleted at claim time inside a transaction that stays open
// while its messages are handled and commits afterwards; no row is ever
// written with a lease. With async, it commits asynchronously.
const rawHeldName = "raw-held"

func (r rawSystem) name() string {
	switch {
	case r.held && r.async:
		return rawHeldName + "-async"
	case r.held:
		return rawHeldName
	case r.insertOnly:
		return rawInsertName
	case r.async:
		return "raw-async"
	}
	return "raw"
}

// rawBatch is how many rows one claim takes.
const rawBatch = 100

// rawLease is the lease the floor's claims take; the drain never comes near
// it, it only has to be a valid lease.
const rawLease = 30 * time.Second

// rawAsyncCommit is pgoutbox's own trick (internal/query/dml.go): an
// always-true condition that makes the statement's implicit transaction
// commit without waiting for the WAL flush (the raw-async variant).
const rawAsyncCommit = ` AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL`

func (r rawSystem) newInstance(ctx context.Context, b *bench, schemaName string) (instance, error) {
	tables := schema.Config{Schema: schemaName, Table: "outbox"}
	if err := schema.Create(ctx, tx.FromPgxPool(b.pool), tables); err != nil {
		return nil, err
	}
	t := pgx.Identifier{schemaName, "outbox"}.Sanitize()
	ac := ""
	if r.async {
		ac = rawAsyncCommit
	}
	insert := `INSERT INTO ` + t + ` (topic, uuid, payload) VALUES ($1, $2, $3)`
	if !r.insertOnly {
		insert = ""
	}
	held := ""
	if r.held {
		// From a cursor ($3, $4), as pgoutbox claims: a scan from the start
		// would walk the dead index entries of its own deletes until VACUUM.
		held = `
DELETE FROM ` + t + `
 WHERE id = ANY (ARRAY(
         SELECT id FROM ` + t + `
          WHERE topic = $1 AND consumer_group = '' AND lease_token IS NULL AND available_at <= now()
            AND (available_at, id) > ($3::timestamptz, $4::bigint)
          ORDER BY available_at, id
          LIMIT $2::int
            FOR UPDATE SKIP LOCKED))
RETURNING id, uuid, payload, metadata, deliveries, available_at, last_error`
	}
	return &rawInstance{
		b:         b,
		heldSQL:   held,
		async:     r.async,
		insertSQL: insert,
		qtable:    t,
		channel:   "bench_raw_" + schemaName,
		publishSQL: `
WITH ins AS (
    INSERT INTO ` + t + ` (topic, uuid, payload)
    SELECT $1, m.uuid, m.payload FROM unnest($2::text[], $3::bytea[]) AS m(uuid, payload)
    RETURNING 1
)
SELECT pg_notify($4, $1) WHERE EXISTS (SELECT 1 FROM ins)`,
		// Copied from internal/query/dml.go (Claim): the floor must pay for
		// the same claim, or the comparison measures a different query.
		claimSQL: `
WITH expired AS (
    SELECT id FROM ` + t + `
     WHERE topic = $1 AND consumer_group = '' AND lease_token IS NOT NULL AND leased_until < now()
     ORDER BY leased_until
     LIMIT $2::int
       FOR UPDATE SKIP LOCKED
), ready AS (
    SELECT id FROM ` + t + `
     WHERE topic = $1 AND consumer_group = '' AND lease_token IS NULL AND available_at <= now()
     ORDER BY available_at, id
     LIMIT (SELECT $2::int - count(*) FROM expired)
       FOR UPDATE SKIP LOCKED
)
UPDATE ` + t + ` o
   SET lease_token  = $3::uuid,
       leased_until = now() + $4::bigint * interval '1 microsecond',
       leased_by    = $5,
       deliveries   = o.deliveries + 1
 WHERE o.id = ANY (ARRAY(SELECT id FROM expired UNION ALL SELECT id FROM ready))` + ac + `
RETURNING o.id, o.uuid, o.payload, o.metadata, o.deliveries, o.available_at, o.last_error`,
		ackSQL: `
DELETE FROM ` + t + ` o
 USING unnest($1::bigint[], $2::uuid[]) AS c(id, token)
 WHERE o.id = c.id AND o.lease_token = c.token` + ac,
	}, nil
}

type rawInstance struct {
	b          *bench
	qtable     string
	channel    string
	publishSQL string
	insertSQL  string // raw-insert: a bare INSERT of one message, no NOTIFY
	claimSQL   string
	ackSQL     string
	heldSQL    string // raw-held: the claim that deletes, in a transaction held while handling
	async      bool
}

func (i *rawInstance) table() string { return i.qtable }

func (i *rawInstance) publish(ctx context.Context, t pgx.Tx, msgs []*message.Message) error {
	if i.insertSQL != "" && len(msgs) == 1 {
		_, err := t.Exec(ctx, i.insertSQL, topic, msgs[0].UUID, msgs[0].Payload)
		return err
	}
	uuids := make([]string, len(msgs))
	payloads := make([][]byte, len(msgs))
	for k, m := range msgs {
		uuids[k], payloads[k] = m.UUID, m.Payload
	}
	_, err := t.Exec(ctx, i.publishSQL, topic, uuids, payloads, i.channel)
	return err
}

func (i *rawInstance) loadBacklog(ctx context.Context, n int, payload []byte) error {
	return loadOutboxBacklog(ctx, i.b, i.qtable, n, payload)
}

func (i *rawInstance) consumer(ctx context.Context, cfg consumeConfig) (consumer, error) {
	work, err := i.b.conn(ctx)
	if err != nil {
		return nil, err
	}
	listen, err := i.b.conn(ctx)
	if err != nil {
		_ = work.Close(ctx)
		return nil, err
	}
	// LISTEN before start, so no notification of the run is missed.
	if _, err := listen.Exec(ctx, `LISTEN `+pgx.Identifier{i.channel}.Sanitize()); err != nil {
		_ = work.Close(ctx)
		_ = listen.Close(ctx)
		return nil, err
	}
	return &rawConsumer{
		failure: newFailure(),
		inst:    i,
		cfg:     cfg,
		work:    work,
		listen:  listen,
		wake:    make(chan struct{}, 1),
		acked:   newCountdown(cfg.acks),
		worker:  "bench-raw:" + watermill.NewShortUUID(),
		heldAt:  heldFromStart,
	}, nil
}

type rawConsumer struct {
	*failure
	inst   *rawInstance
	cfg    consumeConfig
	work   *pgx.Conn // claims and acks
	listen *pgx.Conn // LISTEN only
	wake   chan struct{}
	acked  *countdown
	worker string

	cancel    context.CancelFunc
	loops     sync.WaitGroup
	closeOnce sync.Once

	heldAt pgtype.Timestamptz // raw-held's cursor
	heldID int64
}

var heldFromStart = pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}

func (c *rawConsumer) start(ctx context.Context) error {
	ctx, c.cancel = context.WithCancel(ctx)
	c.loops.Add(2)
	go c.listenLoop(ctx)
	go c.claimLoop(ctx)
	return nil
}

// listenLoop turns notifications into a non-blocking wake-up: one pending
// wake-up is enough, since a claim takes every due row anyway.
func (c *rawConsumer) listenLoop(ctx context.Context) {
	defer c.loops.Done()
	for {
		if _, err := c.listen.WaitForNotification(ctx); err != nil {
			if ctx.Err() == nil {
				c.fail(fmt.Errorf("raw LISTEN: %w", err))
			}
			return
		}
		select {
		case c.wake <- struct{}{}:
		default:
		}
	}
}

// claimLoop is the floor: claim, handle, one DELETE for the batch, again at
// once while there are rows; when a claim comes back empty, sleep until a
// NOTIFY (or a 1 s fallback poll).
func (c *rawConsumer) claimLoop(ctx context.Context) {
	defer c.loops.Done()
	var (
		ids    []int64
		tokens []pgtype.UUID
		// Every column is read, as a real consumer would.
		id          int64
		msgUUID     string
		payload     []byte
		metadata    []byte
		deliveries  int32
		availableAt time.Time
		lastError   pgtype.Text
	)
	for ctx.Err() == nil {
		// Binary UUIDs, as pgoutbox passes them: pgx encodes them directly,
		// where a string would go through a failed binary attempt first.
		token := pgtype.UUID{Bytes: uuid.New(), Valid: true}
		if c.inst.heldSQL != "" {
			n, err := c.heldBatch(ctx)
			if err != nil {
				c.stop(ctx, err)
				return
			}
			if n == 0 && c.heldAt == heldFromStart {
				select {
				case <-ctx.Done():
					return
				case <-c.wake:
				case <-time.After(time.Second):
				}
			}
			continue
		}
		rows, err := c.work.Query(ctx, c.inst.claimSQL, topic, rawBatch, token, rawLease.Microseconds(), c.worker)
		if err != nil {
			c.stop(ctx, fmt.Errorf("raw claim: %w", err))
			return
		}
		ids, tokens = ids[:0], tokens[:0]
		var handleErr error
		_, err = pgx.ForEachRow(rows, []any{&id, &msgUUID, &payload, &metadata, &deliveries, &availableAt, &lastError}, func() error {
			if handleErr == nil {
				handleErr = c.cfg.handle(msgUUID)
			}
			ids = append(ids, id)
			tokens = append(tokens, token)
			return nil
		})
		if err == nil {
			err = handleErr
		}
		if err != nil {
			c.stop(ctx, fmt.Errorf("raw claim: %w", err))
			return
		}
		if len(ids) == 0 {
			select {
			case <-ctx.Done():
				return
			case <-c.wake:
			case <-time.After(time.Second):
			}
			continue
		}
		tag, err := c.work.Exec(ctx, c.inst.ackSQL, ids, tokens)
		if err != nil {
			c.stop(ctx, fmt.Errorf("raw ack: %w", err))
			return
		}
		if got := tag.RowsAffected(); got != int64(len(ids)) {
			c.stop(ctx, fmt.Errorf("raw ack deleted %d of %d rows: leases lost", got, len(ids)))
			return
		}
		c.acked.add(int64(len(ids)))
	}
}

// heldBatch is one batch of the held-transaction ceiling: BEGIN, delete
// up to rawBatch due rows (locked, so competitors skip them), handle them,
// COMMIT. A crash before the commit rolls the deletion back.
func (c *rawConsumer) heldBatch(ctx context.Context) (int, error) {
	t, err := c.work.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("raw-held begin: %w", err)
	}
	defer func() { _ = t.Rollback(context.WithoutCancel(ctx)) }()
	if c.inst.async {
		if _, err := t.Exec(ctx, `SET LOCAL synchronous_commit = off`); err != nil {
			return 0, fmt.Errorf("raw-held: %w", err)
		}
	}
	rows, err := t.Query(ctx, c.inst.heldSQL, topic, rawBatch, c.heldAt, c.heldID)
	if err != nil {
		return 0, fmt.Errorf("raw-held claim: %w", err)
	}
	var (
		id          int64
		msgUUID     string
		payload     []byte
		metadata    []byte
		deliveries  int32
		availableAt time.Time
		lastError   pgtype.Text
		n           int
		handleErr   error
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &msgUUID, &payload, &metadata, &deliveries, &availableAt, &lastError}, func() error {
		if handleErr == nil {
			handleErr = c.cfg.handle(msgUUID)
		}
		n++
		if next := (pgtype.Timestamptz{Time: availableAt, Valid: true}); c.heldAt.InfinityModifier != pgtype.Finite || availableAt.After(c.heldAt.Time) ||
			(availableAt.Equal(c.heldAt.Time) && id > c.heldID) {
			c.heldAt, c.heldID = next, id
		}
		return nil
	})
	if err == nil {
		err = handleErr
	}
	if err != nil {
		return 0, fmt.Errorf("raw-held claim: %w", err)
	}
	if n == 0 {
		c.heldAt, c.heldID = heldFromStart, 0 // the end: next time from the start
		return 0, nil
	}
	if err := t.Commit(ctx); err != nil {
		return 0, fmt.Errorf("raw-held commit: %w", err)
	}
	c.acked.add(int64(n))
	return n, nil
}

// stop records err unless the loop ended because the run was over.
func (c *rawConsumer) stop(ctx context.Context, err error) {
	if ctx.Err() == nil {
		c.fail(err)
	}
}

func (c *rawConsumer) waitAcked(ctx context.Context, timeout time.Duration) error {
	return c.acked.wait(ctx, timeout, "acks written", c.failed())
}

func (c *rawConsumer) close() error {
	var err error
	c.closeOnce.Do(func() {
		if c.cancel != nil {
			c.cancel()
		}
		c.loops.Wait()
		// A query cut off by the cancel leaves the connection closed; that
		// is fine at the end of a run.
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		err = errors.Join(closeConn(cctx, c.work), closeConn(cctx, c.listen))
	})
	return err
}

func closeConn(ctx context.Context, conn *pgx.Conn) error {
	if conn.IsClosed() {
		return nil
	}
	return conn.Close(ctx)
}
