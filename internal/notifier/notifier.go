// Package notifier keeps one LISTEN connection per connection pool and fans
// notifications out to the fetch loops that wait for them.
//
// Sharing it per pool (instead of one per Subscriber) matters in practice:
// a CQRS processor builds one Subscriber per handler, and each LISTEN
// connection is a server backend that is not in the pool's budget.
package notifier

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

var (
	registryMu sync.Mutex
	registry   = map[*pgxpool.Pool]*Notifier{}
)

// Notifier owns the LISTEN connection of one pool.
type Notifier struct {
	pool   *pgxpool.Pool
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	refs    int
	waiters map[string]map[string]map[*Waiter]struct{} // channel -> topic -> waiters
	changed chan struct{}                              // the channel set changed: LISTEN again
	cancel  context.CancelFunc
	done    chan struct{}
}

// Waiter receives a wake-up (a value on C, never blocking the notifier) when
// rows of its topic became due, and after every (re)connect, since
// notifications sent while nobody listened are lost. It receives a value on
// Scheduled when rows of its topic were published for later.
type Waiter struct {
	C         chan struct{}
	Scheduled chan struct{}
	n         *Notifier
	channel   string
	topic     string
}

// Acquire returns the pool's notifier, starting it on first use. Every
// Acquire must be paired with a Release.
func Acquire(pool *pgxpool.Pool, logger watermill.LoggerAdapter) *Notifier {
	registryMu.Lock()
	defer registryMu.Unlock()
	n := registry[pool]
	if n == nil {
		ctx, cancel := context.WithCancel(context.Background())
		n = &Notifier{
			pool:    pool,
			logger:  logger.With(watermill.LogFields{"component": "pgoutbox_notifier"}),
			waiters: map[string]map[string]map[*Waiter]struct{}{},
			changed: make(chan struct{}, 1),
			cancel:  cancel,
			done:    make(chan struct{}),
		}
		registry[pool] = n
		go n.run(ctx)
	}
	n.refs++
	return n
}

// Release drops one reference; the last one stops the LISTEN connection.
func (n *Notifier) Release() {
	registryMu.Lock()
	n.refs--
	last := n.refs == 0
	if last {
		delete(registry, n.pool)
	}
	registryMu.Unlock()
	if last {
		n.cancel()
		<-n.done
	}
}

// Listen registers a waiter for topic on channel.
func (n *Notifier) Listen(channel, topic string) *Waiter {
	w := &Waiter{C: make(chan struct{}, 1), Scheduled: make(chan struct{}, 1), n: n, channel: channel, topic: topic}
	n.mu.Lock()
	byTopic := n.waiters[channel]
	newChannel := byTopic == nil
	if newChannel {
		byTopic = map[string]map[*Waiter]struct{}{}
		n.waiters[channel] = byTopic
	}
	if byTopic[topic] == nil {
		byTopic[topic] = map[*Waiter]struct{}{}
	}
	byTopic[topic][w] = struct{}{}
	n.mu.Unlock()
	if newChannel {
		select {
		case n.changed <- struct{}{}:
		default:
		}
	}
	return w
}

// Stop unregisters the waiter. The channel stays LISTENed until the
// notifier stops: unlistening buys nothing and would race new waiters.
func (w *Waiter) Stop() {
	w.n.mu.Lock()
	defer w.n.mu.Unlock()
	if byTopic := w.n.waiters[w.channel]; byTopic != nil {
		delete(byTopic[w.topic], w)
		if len(byTopic[w.topic]) == 0 {
			delete(byTopic, w.topic)
		}
	}
}

func wake(ws map[*Waiter]struct{}, scheduled bool) {
	for w := range ws {
		c := w.C
		if scheduled {
			c = w.Scheduled
		}
		select {
		case c <- struct{}{}:
		default:
		}
	}
}

// dispatch routes one notification; see query.Publish for the payload.
func (n *Notifier) dispatch(channel, payload string) {
	topic, scheduled := strings.CutPrefix(payload, query.ScheduleMark)
	n.mu.Lock()
	defer n.mu.Unlock()
	wake(n.waiters[channel][topic], scheduled)
}

func (n *Notifier) wakeAll() {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, byTopic := range n.waiters {
		for _, ws := range byTopic {
			wake(ws, false)
		}
	}
}

func (n *Notifier) channels() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make([]string, 0, len(n.waiters))
	for ch := range n.waiters {
		out = append(out, ch)
	}
	return out
}

func (n *Notifier) run(ctx context.Context) {
	defer close(n.done)
	// Options, not fields: NewExponentialBackOff resets itself, so fields
	// set afterwards would only apply after the next Reset.
	bo := backoff.NewExponentialBackOff(backoff.WithInitialInterval(100*time.Millisecond),
		backoff.WithMaxInterval(5*time.Second), backoff.WithMaxElapsedTime(0))
	failures := 0
	for ctx.Err() == nil {
		err := n.session(ctx, func() { bo.Reset(); failures = 0 })
		if ctx.Err() != nil {
			return
		}
		failures++
		if failures == 1 {
			n.logger.Error("LISTEN connection failed; fetch loops fall back to polling until it is back", err, nil)
		} else {
			n.logger.Debug("LISTEN reconnect failed", watermill.LogFields{"err": err.Error()})
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(bo.NextBackOff()):
		}
	}
}

// session runs one LISTEN connection until it fails or ctx ends.
func (n *Notifier) session(ctx context.Context, connected func()) error {
	cfg := n.pool.Config().ConnConfig.Copy()
	connectCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	conn, err := pgx.ConnectConfig(connectCtx, cfg)
	cancel()
	if err != nil {
		return err
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()

	listening := map[string]bool{}
	listenAll := func() error {
		for _, ch := range n.channels() {
			if listening[ch] {
				continue
			}
			if _, err := conn.Exec(ctx, "LISTEN "+query.Quote(ch)); err != nil {
				return err
			}
			listening[ch] = true
		}
		return nil
	}
	if err := listenAll(); err != nil {
		return err
	}
	connected()
	// Anything notified while we were not listening is lost: have every
	// loop poll once now instead of waiting out its idle interval.
	n.wakeAll()

	for {
		waitCtx, stopWait := context.WithCancel(ctx)
		watcherDone := make(chan struct{})
		go func() {
			defer close(watcherDone)
			select {
			case <-n.changed:
				stopWait()
			case <-waitCtx.Done():
			}
		}()
		note, err := conn.WaitForNotification(waitCtx)
		interrupted := waitCtx.Err() != nil
		stopWait()
		// The watcher may still take the "changed" signal after the wait
		// ended: let it finish first, so listenAll below sees the channel
		// that signal announced (it is registered before it is signalled).
		<-watcherDone
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if note != nil {
			n.dispatch(note.Channel, note.Payload)
		}
		if err != nil && !interrupted {
			return err
		}
		if conn.IsClosed() {
			return errors.New("LISTEN connection closed")
		}
		// Every turn, not only after an interruption: the signal that a
		// channel was added may have been consumed by a wait that a
		// notification ended first. Without a new channel this costs
		// nothing.
		if err := listenAll(); err != nil {
			return err
		}
	}
}
