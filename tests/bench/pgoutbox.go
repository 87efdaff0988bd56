package main

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Settings of the timers scenario: a subscriber that would poll only every
// 10 s, so a timer can only be on time through the publish's wake-up and
// the subscriber's planning of the next due row.
const (
	timersLease       = 30 * time.Second
	timersPoll        = 10 * time.Second
	timersMaxInFlight = 16
)

// pgoutboxSystem is the library under test, used as its README shows:
// a publisher per transaction, a Subscriber on a pgxpool, a Router.
// notifyEach makes "pgoutbox-notify-each": publishers NOTIFY in every
// transaction (NotifyCooldown -1), the behaviour before the cooldown; only
// the scenarios that name it run it.
// lease makes "pgoutbox-lease": ClaimMode ClaimLease, every claim a lease
// (the only path before held claims). txHandler makes "pgoutbox-tx": the
// Router runs each handler in tx.Middleware, whose transaction deletes the
// row (the transactional handlers' path: a lease per row, completed in the
// handler's own commit).
// rotating makes "pgoutbox-ring": the library's rotating outbox
// (schema.Config.Rotating), rotated by its subscriber. arrivals makes
// "pgoutbox-arrivals": an outbox with arrivals (schema.Config.Arrivals),
// where plain messages arrive in a table of their own; with lease,
// "pgoutbox-arrivals-lease".
type pgoutboxSystem struct{ notifyEach, lease, txHandler, rotating, arrivals bool }

const (
	pgoutboxNotifyEachName = "pgoutbox-notify-each"
	pgoutboxLeaseName      = "pgoutbox-lease"
	pgoutboxTxName         = "pgoutbox-tx"
	pgoutboxRingName       = "pgoutbox-ring"
	pgoutboxArrivalsName   = "pgoutbox-arrivals"
	pgoutboxArrivalsLease  = "pgoutbox-arrivals-lease"
)

func (s pgoutboxSystem) name() string {
	switch {
	case s.arrivals && s.lease:
		return pgoutboxArrivalsLease
	case s.notifyEach:
		return pgoutboxNotifyEachName
	case s.lease:
		return pgoutboxLeaseName
	case s.txHandler:
		return pgoutboxTxName
	case s.rotating:
		return pgoutboxRingName
	case s.arrivals:
		return pgoutboxArrivalsName
	}
	return "pgoutbox"
}

func (s pgoutboxSystem) newInstance(ctx context.Context, b *bench, schemaName string) (instance, error) {
	tables := schema.Config{Schema: schemaName, Table: "outbox", Rotating: s.rotating, Arrivals: s.arrivals}
	if err := schema.Create(ctx, tx.FromPgxPool(b.pool), tables); err != nil {
		return nil, err
	}
	cooldown := time.Duration(0) // the default
	if s.notifyEach {
		cooldown = -1
	}
	mode := pgoutbox.ClaimAuto
	if s.lease {
		mode = pgoutbox.ClaimLease
	}
	return &pgoutboxInstance{b: b, tables: tables, cooldown: cooldown, mode: mode, txHandler: s.txHandler}, nil
}

type pgoutboxInstance struct {
	b         *bench
	tables    schema.Config
	cooldown  time.Duration
	mode      pgoutbox.ClaimMode
	txHandler bool
}

func (i *pgoutboxInstance) table() string {
	return pgx.Identifier{i.tables.Schema, i.tables.Table}.Sanitize()
}

func (i *pgoutboxInstance) publish(_ context.Context, t pgx.Tx, msgs []*message.Message) error {
	// One publisher per transaction, as documented: it is cheap.
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(t), pgoutbox.PublisherConfig{Tables: i.tables, NotifyCooldown: i.cooldown}, nil)
	if err != nil {
		return err
	}
	return pub.Publish(topic, msgs...)
}

func (i *pgoutboxInstance) loadBacklog(ctx context.Context, n int, payload []byte) error {
	if i.tables.Arrivals {
		// Where a Publish of plain messages puts them.
		return loadOutboxBacklog(ctx, i.b, i.arrivalsTable(), n, payload)
	}
	return loadOutboxBacklog(ctx, i.b, i.table(), n, payload)
}

func (i *pgoutboxInstance) arrivalsTable() string {
	return pgx.Identifier{i.tables.Schema, i.tables.Table + "_arrivals"}.Sanitize()
}

// countRows counts the messages stored: with arrivals, in both tables.
func (i *pgoutboxInstance) countRows(ctx context.Context) (int64, error) {
	q := `SELECT count(*) FROM ` + i.table()
	if i.tables.Arrivals {
		q = `SELECT (SELECT count(*) FROM ` + i.table() + `) + (SELECT count(*) FROM ` + i.arrivalsTable() + `)`
	}
	var n int64
	err := i.b.pool.QueryRow(ctx, q).Scan(&n)
	return n, err
}

// loadOutboxBacklog fills a pgoutbox-format table (pgoutbox and raw share
// the DDL): metadata, available_at and the lease columns keep their
// defaults, exactly as a Publish without options would store them.
func loadOutboxBacklog(ctx context.Context, b *bench, table string, n int, payload []byte) error {
	_, err := b.pool.Exec(ctx, `
		INSERT INTO `+table+` (topic, uuid, payload)
		SELECT $1, gen_random_uuid()::text, $2::bytea FROM generate_series(1, $3)`,
		topic, payload, n)
	return err
}

func (i *pgoutboxInstance) consumer(_ context.Context, cfg consumeConfig) (consumer, error) {
	acked := newCountdown(cfg.acks)
	var rc *routerConsumer
	scfg := pgoutbox.SubscriberConfig{
		Tables:            i.tables,
		ConsumerGroup:     cfg.group,
		MaxInFlight:       cfg.maxInFlight,
		SynchronousCommit: i.b.opts.syncCommit,
		ClaimMode:         i.mode,
		RotationWindow:    i.b.opts.rotationWindow,
		// Acks are counted when the subscriber reports them written: a
		// drain is over when the rows are gone, not when the handler
		// returned. Anything else that ends a row without an ack breaks
		// the run.
		Observer: pgoutbox.ObserverFunc(func(e pgoutbox.Event) {
			switch e.Kind {
			case pgoutbox.EventAcked:
				acked.add(1)
			case pgoutbox.EventLeaseLost, pgoutbox.EventPoisoned, pgoutbox.EventDeadLettered, pgoutbox.EventRetried:
				rc.fail(fmt.Errorf("pgoutbox reported %s for row %d (phase %q, reason %q): %v", e.Kind, e.RowID, e.Phase, e.Reason, e.Err))
			}
		}),
	}
	if cfg.timers {
		scfg.Lease = timersLease
		scfg.MinPollInterval = timersPoll
		scfg.MaxPollInterval = timersPoll
	}
	sub, err := pgoutbox.NewSubscriber(i.b.pool, scfg, i.b.logger)
	if err != nil {
		return nil, err
	}
	var mw []message.HandlerMiddleware
	if i.txHandler {
		m, err := tx.Middleware(tx.FromPgxPool(i.b.pool), tx.MiddlewareConfig{})
		if err != nil {
			_ = sub.Close()
			return nil, err
		}
		mw = append(mw, m)
	}
	rc, err = newRouterConsumer(i.b, sub, cfg.handle, mw...)
	if err != nil {
		_ = sub.Close()
		return nil, err
	}
	rc.waitAckedFn = func(ctx context.Context, timeout time.Duration) error {
		return acked.wait(ctx, timeout, "acks written", rc.failed())
	}
	return rc, nil
}
