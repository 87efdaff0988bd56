package tests

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// A claim the network slowed but delivered in time must not move the next
// claims' deadlines later: the subscriber read the server's clock against
// the time a claim was sent, so a reading after a slow trip ran ahead by
// that trip, and so did the next claim's deadline. That next claim, held
// back past its client's bound, reached the server after the release of
// its rows had run (and found nothing), still within its deadline, and
// leased the message just published under a token nobody holds: it came
// a Lease later, on its second attempt. Now the clock is read against
// the answer's arrival (never ahead), and a lost claim is released once
// more once its deadline has passed. The control case slows no claim
// before the one held back.
func TestALeaseClaimAfterASlowAnswerKeepsADeadlineItsClientKeeps(t *testing.T) {
	for _, tc := range []struct {
		name       string
		firstDelay time.Duration
	}{{"no claim slowed before", 0}, {"the claim before slowed 1.5 s", 1500 * time.Millisecond}} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t)
			marker := "slow-claim-" + watermill.NewShortUUID()
			px := startClaimDelayProxy(t, b.DSN, marker)
			pool := (&tcpProxy{addr: px.addr}).pool(t, b, "slow-claim-"+b.Schema, nil)
			ev := newEvents()
			const lease, st = 10 * time.Second, 2 * time.Second
			sub := b.subscriberOn(t, pool, func(c *pgoutbox.SubscriberConfig) {
				c.ClaimMode, c.Lease, c.StatementTimeout, c.WorkerID = pgoutbox.ClaimLease, lease, st, marker
				c.MinPollInterval, c.MaxPollInterval = 100*time.Millisecond, 200*time.Millisecond
				c.Observer = ev
			})
			msgs, err := sub.Subscribe(t.Context(), "t")
			require.NoError(t, err)
			waitEmptyClaim(t, ev)

			// The first claim from now on is slowed (answered within st),
			// the second held back past st.
			px.arm(tc.firstDelay+time.Millisecond, st+600*time.Millisecond)
			select {
			case <-px.second:
			case <-time.After(20 * time.Second):
				t.Fatal("no second claim")
			}
			// The second claim is on its way, held back: publish now.
			start := time.Now()
			b.publishInTx(t, "t", true, newMsg("B"))
			m := receive(t, msgs, 3*lease)
			took := time.Since(start)
			d, _ := pgoutbox.DeliveryOf(m)
			m.Ack()
			require.Less(t, took, lease, "the message waited for a lease a claim took under a token nobody holds (attempt %d)", d.Attempt)
			require.Equal(t, 1, d.Attempt, "its delivery was not counted for a claim nobody saw")
		})
	}
}

// claimDelayProxy forwards connections and holds back the client's chunks
// that carry a lease claim (the WorkerID marker among its parameters) by a
// delay from a list once armed: the first claim by delays[0], the second
// by delays[1]; later claims wait until the second was sent on (and a
// moment), so that none overtakes it. Other statements (releases, acks)
// pass at once.
type claimDelayProxy struct {
	addr     string
	marker   []byte
	mu       sync.Mutex
	armed    bool
	delays   []time.Duration
	seen     int
	secondAt time.Time     // when the second claim is sent on
	second   chan struct{} // closed when the second claim is seen
}

func startClaimDelayProxy(t *testing.T, dsn, marker string) *claimDelayProxy {
	p := &claimDelayProxy{marker: []byte(marker), second: make(chan struct{})}
	p.addr = serveProxy(t, dsn, func(c, up net.Conn) {
		go func() { // client to server
			buf := make([]byte, 64<<10)
			for {
				n, err := c.Read(buf)
				if n > 0 {
					if bytes.Contains(buf[:n], p.marker) {
						if d := p.delayFor(); d > 0 {
							time.Sleep(d)
						}
					}
					if _, werr := up.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					// The server runs what it got before it sees the end, as
					// it does with what a network delivers late.
					time.Sleep(2 * time.Second)
					_ = up.Close()
					return
				}
			}
		}()
		go func() { // server to client
			buf := make([]byte, 64<<10)
			for {
				n, err := up.Read(buf)
				if n > 0 {
					_, _ = c.Write(buf[:n]) // a client gone: what the server says is dropped
				}
				if err != nil {
					_ = c.Close()
					return
				}
			}
		}()
	})
	return p
}

func (p *claimDelayProxy) arm(delays ...time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.armed, p.delays, p.seen = true, delays, 0
}

func (p *claimDelayProxy) delayFor() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.armed {
		return 0
	}
	p.seen++
	switch {
	case p.seen <= len(p.delays):
		d := p.delays[p.seen-1]
		if p.seen == 2 {
			p.secondAt = time.Now().Add(d)
			close(p.second)
		}
		return d
	default:
		return time.Until(p.secondAt.Add(300 * time.Millisecond))
	}
}

// Claims slower than half their StatementTimeout, each answered in time,
// keep claiming. The server's clock was read by the time a claim checked
// its deadline, before its scans, against the time its answer came: the
// reading put the server behind by the claim's length, the next claim's
// deadline came early by as much, and its last statement (the deadline's
// check after the scans) failed it; so did every claim after it, each
// failure read the same way, and delivery stopped. A trigger makes each
// lease take 1.2 s; StatementTimeout is 2 s.
func TestClaimsSlowerThanHalfTheirTimeoutKeepClaiming(t *testing.T) {
	t.Parallel()
	onEachLayout(t, func(t *testing.T, b *bundle) {
		ctx := context.Background()
		_, err := b.Pool.Exec(ctx, `
CREATE FUNCTION `+b.Schema+`.slow() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(1.2); RETURN NEW; END $$;
CREATE TRIGGER slow BEFORE UPDATE ON `+b.Schema+`.outbox FOR EACH ROW
  WHEN (NEW.lease_token IS NOT NULL AND OLD.lease_token IS NULL) EXECUTE FUNCTION `+b.Schema+`.slow();
CREATE TRIGGER slow_move BEFORE INSERT ON `+b.Schema+`.outbox FOR EACH ROW
  WHEN (NEW.lease_token IS NOT NULL) EXECUTE FUNCTION `+b.Schema+`.slow()`)
		require.NoError(t, err)
		const n = 4
		logs := &logCapture{}
		b.logger = logs
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			c.ClaimMode, c.MaxInFlight, c.Lease, c.StatementTimeout = pgoutbox.ClaimLease, 1, 10*time.Second, 2*time.Second
		})
		msgs, err := sub.Subscribe(t.Context(), "t")
		require.NoError(t, err)
		for i := range n {
			require.NoError(t, b.poolPublisher(t).Publish("t", newMsg(fmt.Sprint(i))))
			m := receive(t, msgs, 30*time.Second)
			m.Ack()
		}
		require.Empty(t, logs.find("error", func(e logEntry) bool {
			return e.err != nil && strings.Contains(e.err.Error(), "past its deadline")
		}), "claims answered in time failed their deadline's check")
	})
}
