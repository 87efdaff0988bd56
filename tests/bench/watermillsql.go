package main

import (
	"context"
	"fmt"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
)

// watermillSQLSystem is watermill-sql v4 in its queue configuration
// (PostgreSQLQueueSchema, delete on ack), the closest of its modes to an
// outbox that is consumed once: pgx throughout, its documented defaults
// otherwise.
type watermillSQLSystem struct{}

func (watermillSQLSystem) name() string { return "watermill-sql" }

// wsqlPollInterval is watermill-sql's documented default. It also polls
// only when idle: after a non-empty batch it queries again at once, so the
// drains are not slowed by it; idle latency is.
const wsqlPollInterval = time.Second

func (watermillSQLSystem) newInstance(ctx context.Context, b *bench, schemaName string) (instance, error) {
	if _, err := b.pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{schemaName}.Sanitize()); err != nil {
		return nil, err
	}
	// The table goes into the run's schema, named as watermill-sql would
	// name it by default ("watermill_<topic>").
	tableName := func(topic string) string {
		return pgx.Identifier{schemaName, "watermill_" + topic}.Sanitize()
	}
	i := &watermillSQLInstance{
		b:      b,
		qtable: tableName(topic),
		schema: wsql.PostgreSQLQueueSchema{
			GeneratePayloadType:       func(string) string { return "BYTEA" },
			GenerateMessagesTableName: tableName,
		},
		offsets: wsql.PostgreSQLQueueOffsetsAdapter{
			DeleteOnAck:               true,
			GenerateMessagesTableName: tableName,
		},
	}
	// A publisher bound to a transaction may not create tables (that could
	// commit the caller's transaction), so create it up front, the way
	// watermill-sql does on Subscribe.
	sub, err := i.newSubscriber()
	if err != nil {
		return nil, err
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(topic); err != nil {
		return nil, fmt.Errorf("initialize watermill-sql schema: %w", err)
	}
	return i, nil
}

type watermillSQLInstance struct {
	b       *bench
	qtable  string
	schema  wsql.PostgreSQLQueueSchema
	offsets wsql.PostgreSQLQueueOffsetsAdapter
}

func (i *watermillSQLInstance) table() string { return i.qtable }

func (i *watermillSQLInstance) newSubscriber() (*wsql.Subscriber, error) {
	return wsql.NewSubscriber(wsql.BeginnerFromPgx(i.b.pool), wsql.SubscriberConfig{
		SchemaAdapter:    i.schema,
		OffsetsAdapter:   i.offsets,
		InitializeSchema: true,
		PollInterval:     wsqlPollInterval,
	}, i.b.logger)
}

func (i *watermillSQLInstance) publish(_ context.Context, t pgx.Tx, msgs []*message.Message) error {
	// One publisher per transaction, as watermill-sql documents.
	pub, err := wsql.NewPublisher(wsql.TxFromPgx(t), wsql.PublisherConfig{SchemaAdapter: i.schema}, i.b.logger)
	if err != nil {
		return err
	}
	return pub.Publish(topic, msgs...)
}

// loadBacklog writes rows exactly as its publisher would for a message
// without metadata: uuid, the payload as BYTEA and "{}" as JSON.
func (i *watermillSQLInstance) loadBacklog(ctx context.Context, n int, payload []byte) error {
	_, err := i.b.pool.Exec(ctx, `
		INSERT INTO `+i.qtable+` (uuid, payload, metadata)
		SELECT gen_random_uuid()::text, $1::bytea, '{}'::json FROM generate_series(1, $2)`,
		payload, n)
	return err
}

func (i *watermillSQLInstance) consumer(_ context.Context, cfg consumeConfig) (consumer, error) {
	// cfg.maxInFlight has no counterpart: the subscriber hands out one
	// message at a time and waits for its ack (inFlightNote says so).
	sub, err := i.newSubscriber()
	if err != nil {
		return nil, err
	}
	rc, err := newRouterConsumer(i.b, sub, cfg.handle)
	if err != nil {
		_ = sub.Close()
		return nil, err
	}
	// watermill-sql reports no acks; its acks are written (rows deleted) in
	// the batch's transaction after the last message of the batch. So, once
	// every message was handled, wait for the table to be empty. The check
	// is cheap here: watermill-sql is not in the 1,000,000-row scenario.
	rc.waitAckedFn = func(ctx context.Context, timeout time.Duration) error {
		deadline := time.Now().Add(timeout)
		for {
			var empty bool
			if err := i.b.pool.QueryRow(ctx, `SELECT NOT EXISTS (SELECT 1 FROM `+i.qtable+`)`).Scan(&empty); err != nil {
				return err
			}
			if empty {
				return nil
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("timed out after %s waiting for watermill-sql's acks", timeout)
			}
			select {
			case <-rc.failed():
				return rc.err()
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(time.Millisecond):
			}
		}
	}
	return rc, nil
}
