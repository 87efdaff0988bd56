// Basic shows the transactional outbox end to end: an order and its
// "order placed" message are written in one transaction, a Watermill router
// consumes the message, and a rolled-back order leaves no message behind.
//
//	make demo    (or: POSTGRES_DSN=postgres://... go run ./_examples/basic)
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"log"
	"log/slog"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

const topic = "orders.placed"

type orderPlaced struct {
	OrderID int64  `json:"order_id"`
	Item    string `json:"item"`
}

func main() {
	if err := run(); err != nil {
		log.Fatalf("demo failed: %v", err)
	}
}

func run() error {
	ctx := context.Background()
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return err
	}
	defer db.Close()

	// A schema of its own keeps the demo away from your tables.
	tables := schema.Config{Schema: "pgoutbox_demo", Table: "outbox"}
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS pgoutbox_demo CASCADE`); err != nil {
		return err
	}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE pgoutbox_demo.orders (id bigint PRIMARY KEY, item text NOT NULL)`); err != nil {
		return err
	}

	// 1. The domain change and its message commit together ...
	if err := placeOrder(ctx, db, tables, 1, "espresso machine", true); err != nil {
		return err
	}
	fmt.Println("committed: order 1 and its orders.placed message, in one transaction")
	// ... and roll back together.
	if err := placeOrder(ctx, db, tables, 2, "grinder", false); err != nil {
		return err
	}
	fmt.Println("rolled back: order 2 and its message (neither exists)")

	// 2. A Watermill router consumes the outbox.
	// Warnings and errors only, so the demo's own lines stand out.
	logger := pgoutbox.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))) // warnings at slog.LevelWarn
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: tables}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 40 * time.Second}, logger)
	if err != nil {
		return err
	}
	// The first added is the outermost; _examples/middleware-stack has the whole
	// recommended stack.
	router.AddMiddleware(pgoutbox.ErrorRecorder, middleware.CorrelationID)

	handled := make(chan orderPlaced, 1)
	router.AddConsumerHandler("ship_order", topic, sub, func(msg *message.Message) error {
		var ev orderPlaced
		if err := json.Unmarshal(msg.Payload, &ev); err != nil {
			return pgoutbox.Reject(msg, "payload is not an orderPlaced event")
		}
		fmt.Printf("handled: %s order_id=%d item=%q (message %s)\n", topic, ev.OrderID, ev.Item, msg.UUID)
		handled <- ev
		return nil
	})

	routerErr := make(chan error, 1)
	go func() { routerErr <- router.Run(ctx) }()

	select {
	case ev := <-handled:
		if ev.OrderID != 1 {
			return fmt.Errorf("handled order %d, want 1", ev.OrderID)
		}
	case err := <-routerErr:
		return fmt.Errorf("router stopped: %v", err)
	case <-time.After(30 * time.Second):
		return fmt.Errorf("no message handled within 30s")
	}
	// Closing the router closes the subscriber, which writes the pending ack.
	if err := router.Close(); err != nil {
		return err
	}
	if err := <-routerErr; err != nil {
		return err
	}

	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pgoutbox_demo.outbox`).Scan(&left); err != nil {
		return err
	}
	if left != 0 {
		return fmt.Errorf("%d message(s) left in the outbox, want 0", left)
	}
	fmt.Println("acked: the outbox is empty; demo finished")
	return nil
}

// placeOrder writes an order and its message in one database/sql
// transaction, then commits or rolls back.
func placeOrder(ctx context.Context, db *sql.DB, tables schema.Config, id int64, item string, commit bool) error {
	t, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer t.Rollback() //nolint:errcheck // a no-op after Commit

	if _, err := t.ExecContext(ctx, `INSERT INTO pgoutbox_demo.orders (id, item) VALUES ($1, $2)`, id, item); err != nil {
		return err
	}
	pub, err := pgoutbox.NewTxPublisher(t, pgoutbox.PublisherConfig{Tables: tables}, nil)
	if err != nil {
		return err
	}
	payload, _ := json.Marshal(orderPlaced{OrderID: id, Item: item})
	msg := message.NewMessage(watermill.NewUUID(), payload)
	middleware.SetCorrelationID(watermill.NewShortUUID(), msg)
	if err := pub.Publish(topic, msg); err != nil {
		return err
	}
	if !commit {
		return t.Rollback()
	}
	return t.Commit()
}
