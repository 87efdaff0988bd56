// Transactional-handler runs a Router handler inside a database
// transaction with tx.Middleware: the handler updates an account balance
// through tx.PgxTxFromContext and returns a "deposit applied" message; the
// middleware publishes it, deletes the incoming message's row and commits,
// all in that one transaction. One attempt fails after its write: the
// write rolls back with it, the message is redelivered, and the retry
// applies the deposit once. Effectively once: each deposit changes the
// balance once and produces one output message.
//
//	POSTGRES_DSN=postgres://... go run ./_examples/transactional-handler
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

const (
	inTopic  = "deposits.requested"
	outTopic = "deposits.applied"
)

// Deposit is the incoming message: money to add to an account.
type Deposit struct {
	ID      string `json:"id"`
	Account string `json:"account"`
	Amount  int64  `json:"amount"`
}

// DepositApplied is the handler's output: the deposit and the balance it
// left.
type DepositApplied struct {
	DepositID string `json:"deposit_id"`
	Account   string `json:"account"`
	Balance   int64  `json:"balance"`
}

func main() {
	if err := run(); err != nil {
		log.Fatalf("transactional-handler example failed: %v", err)
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
	tables := schema.Config{Schema: "pgoutbox_txhandler_example", Table: "outbox"}
	sch := pgx.Identifier{tables.Schema}.Sanitize()
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+sch+` CASCADE`); err != nil {
		return err
	}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA `+sch+` CASCADE`) //nolint:errcheck
	if _, err := pool.Exec(ctx, `CREATE TABLE `+sch+`.accounts (id text PRIMARY KEY, balance bigint NOT NULL);
		INSERT INTO `+sch+`.accounts VALUES ('alice', 0), ('bob', 0)`); err != nil {
		return err
	}
	balance := func(account string) (b int64, err error) {
		err = pool.QueryRow(ctx, `SELECT balance FROM `+sch+`.accounts WHERE id = $1`, account).Scan(&b)
		return b, err
	}

	logger := watermill.NopLogger{}
	// Built once: it publishes in the transaction the message's context
	// carries (the handler's, put there by tx.Middleware), else through
	// the pool (the deposits published below).
	pub, err := pgoutbox.NewContextPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: tables}, logger)
	if err != nil {
		return err
	}
	txMiddleware, err := tx.Middleware(tx.FromPgxPool(pool), tx.MiddlewareConfig{Publisher: pub})
	if err != nil {
		return err
	}
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{
		Tables: tables,
		// A failed delivery comes back after 50 ms (the default backs off
		// from 1s). With MaxInFlight 1 it comes back before later messages.
		RetryPolicy: pgoutbox.ConstantBackoff{Delay: 50 * time.Millisecond, MaxAttempts: 5},
	}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 40 * time.Second}, logger)
	if err != nil {
		return err
	}

	// Outside tx.Middleware, this middleware sees each attempt's outcome
	// after its commit or rollback.
	committed := make(chan string, 10)
	var mu sync.Mutex
	attempts := map[string]int{} // by deposit id
	router.AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			var d Deposit
			_ = json.Unmarshal(msg.Payload, &d)
			mu.Lock()
			attempts[d.ID]++
			n := attempts[d.ID]
			mu.Unlock()
			produced, err := next(msg)
			if err != nil {
				b, _ := balance(d.Account)
				fmt.Printf("%s: attempt %d failed (%v); rolled back, %s's balance is still %d\n", d.ID, n, err, d.Account, b)
				return produced, err
			}
			b, _ := balance(d.Account)
			fmt.Printf("%s: committed: %s's balance is now %d, a DepositApplied message published with it\n", d.ID, d.Account, b)
			committed <- d.ID
			return produced, nil
		}
	}, txMiddleware)

	var failedOnce atomic.Bool
	router.AddHandler("apply_deposit", inTopic, sub, outTopic, pub, func(msg *message.Message) ([]*message.Message, error) {
		var d Deposit
		if err := json.Unmarshal(msg.Payload, &d); err != nil {
			return nil, pgoutbox.Reject(msg, "payload is not a Deposit")
		}
		pgTx, ok := tx.PgxTxFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no transaction in the message's context: is tx.Middleware on the router?")
		}
		var newBalance int64
		err := pgTx.QueryRow(msg.Context(), `UPDATE `+sch+`.accounts SET balance = balance + $2 WHERE id = $1 RETURNING balance`,
			d.Account, d.Amount).Scan(&newBalance)
		if err != nil {
			return nil, err
		}
		if d.ID == "dep-3" && failedOnce.CompareAndSwap(false, true) {
			// After the write: the rollback must undo it.
			return nil, errors.New("fraud check unavailable")
		}
		payload, err := json.Marshal(DepositApplied{DepositID: d.ID, Account: d.Account, Balance: newBalance})
		if err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), payload)}, nil
	})

	routerErr := make(chan error, 1)
	go func() { routerErr <- router.Run(ctx) }()
	<-router.Running()

	deposits := []Deposit{{"dep-1", "alice", 100}, {"dep-2", "bob", 50}, {"dep-3", "alice", 25}, {"dep-4", "bob", 10}}
	for _, d := range deposits {
		payload, err := json.Marshal(d)
		if err != nil {
			return err
		}
		if err := pub.Publish(inTopic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			return err
		}
	}
	timeout := time.After(10 * time.Second)
	for range deposits {
		select {
		case <-committed:
		case err := <-routerErr:
			return fmt.Errorf("router stopped: %v", err)
		case <-timeout:
			return errors.New("timed out waiting for the deposits to commit")
		}
	}
	if err := router.Close(); err != nil {
		return err
	}
	if err := <-routerErr; err != nil {
		return err
	}

	// Each deposit counted once, the failed attempt's write undone.
	mu.Lock()
	defer mu.Unlock()
	if attempts["dep-3"] != 2 {
		return fmt.Errorf("dep-3 took %d attempts, want 2", attempts["dep-3"])
	}
	for account, want := range map[string]int64{"alice": 125, "bob": 60} {
		got, err := balance(account)
		if err != nil {
			return err
		}
		if got != want {
			return fmt.Errorf("%s's balance is %d, want %d", account, got, want)
		}
	}
	var inLeft, outRows, outDeposits int
	err = pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE topic = $1), count(*) FILTER (WHERE topic = $2),
			count(DISTINCT convert_from(payload, 'UTF8')::jsonb->>'deposit_id') FILTER (WHERE topic = $2)
		FROM `+pgx.Identifier{tables.Schema, tables.Table}.Sanitize(), inTopic, outTopic).Scan(&inLeft, &outRows, &outDeposits)
	if err != nil {
		return err
	}
	if inLeft != 0 || outRows != len(deposits) || outDeposits != len(deposits) {
		return fmt.Errorf("%d input rows left (want 0), %d output rows for %d deposits (want %d for %d)",
			inLeft, outRows, outDeposits, len(deposits), len(deposits))
	}
	fmt.Printf("balances alice=125 bob=60; %d DepositApplied messages, one per deposit; no deposit left in the outbox\n", outRows)
	return nil
}
