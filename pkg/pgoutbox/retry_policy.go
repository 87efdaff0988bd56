package pgoutbox

import (
	"math"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// RetryPolicy decides when a failed message is delivered again. It is pure:
// it returns a duration and the database applies it as now() + delay, so the
// subscriber's clock never gates delivery.
//
// NextDelay is called after the deliveries-th delivery of a message failed;
// err is the handler's error when ErrorRecorder is installed, else nil.
// retry=false gives up: the message goes to the dead-letter table (or,
// without one, is parked in the outbox) with reason "retry_exhausted". A
// NextDelay that panics is logged, and DefaultRetryPolicy decides that
// delivery instead. A delay below zero is none; one over about 73 years
// is cut to that.
type RetryPolicy interface {
	NextDelay(deliveries int, err error) (delay time.Duration, retry bool)
}

// RetryPolicyFunc adapts a function to RetryPolicy, for example to retry
// only transient errors:
//
//	pgoutbox.RetryPolicyFunc(func(n int, err error) (time.Duration, bool) {
//		if errors.Is(err, ErrInvalidOrder) {
//			return 0, false
//		}
//		return pgoutbox.DefaultRetryPolicy().NextDelay(n, err)
//	})
type RetryPolicyFunc func(deliveries int, err error) (time.Duration, bool)

// NextDelay calls f.
func (f RetryPolicyFunc) NextDelay(deliveries int, err error) (time.Duration, bool) {
	return f(deliveries, err)
}

// DefaultRetryPolicy is ExponentialBackoff with its defaults: 1s, doubling,
// capped at 5 minutes, jitter ±20%, 10 deliveries in all.
func DefaultRetryPolicy() RetryPolicy { return ExponentialBackoff{} }

// ExponentialBackoff waits InitialInterval after the first failure and
// Multiplier times longer after each next one, up to MaxInterval, spread by
// ±Jitter. It is built on github.com/cenkalti/backoff/v4.
type ExponentialBackoff struct {
	// InitialInterval is the delay after the first failed delivery. Defaults to 1s.
	InitialInterval time.Duration
	// Multiplier grows the delay after each failure. Defaults to 2.
	Multiplier float64
	// MaxInterval caps the delay (before jitter). Defaults to 5 minutes.
	MaxInterval time.Duration
	// MaxAttempts is the number of deliveries before giving up. Defaults
	// to 10. The special value RetryForever (-1) retries forever.
	MaxAttempts int
	// Jitter spreads each delay uniformly over [d*(1-Jitter), d*(1+Jitter)];
	// from 0 to 1. Defaults to 0.2. The special value NoJitter (-1)
	// disables it.
	Jitter float64
}

// policyProblem is one field of a retry policy that cannot work.
type policyProblem struct {
	policy, field string
	value         any
	want          string
}

// problems lists the fields that cannot work (zero values are defaults).
// SubscriberConfig.Validate and the environment path both use it.
func (b ExponentialBackoff) problems() []policyProblem {
	var out []policyProblem
	add := func(field string, value any, want string) {
		out = append(out, policyProblem{"ExponentialBackoff", field, value, want})
	}
	if b.InitialInterval < 0 {
		add("InitialInterval", b.InitialInterval, "a positive duration (0 for the default 1s)")
	}
	if b.MaxInterval < 0 {
		add("MaxInterval", b.MaxInterval, "a positive duration (0 for the default 5m)")
	} else if b.MaxInterval > 0 && b.MaxInterval < b.InitialInterval {
		add("MaxInterval", b.MaxInterval, "at least InitialInterval ("+b.InitialInterval.String()+")")
	}
	if b.Multiplier != 0 && !(b.Multiplier >= 1) { // !(>=) also catches NaN
		add("Multiplier", b.Multiplier, "1 or more, such as 2 (doubling) or 1.5 (0 for the default 2)")
	}
	if b.MaxAttempts < RetryForever {
		add("MaxAttempts", b.MaxAttempts, "a positive number of deliveries, 0 for the default 10, or RetryForever (-1)")
	}
	if b.Jitter != NoJitter && !(b.Jitter >= 0 && b.Jitter <= 1) {
		add("Jitter", b.Jitter, "a number from 0 to 1 (0.2 spreads delays by ±20%), or NoJitter (-1)")
	}
	return out
}

// retryPolicyProblems lists what cannot work in the policies pgoutbox
// ships; a policy of your own is yours to check.
func retryPolicyProblems(p RetryPolicy) []policyProblem {
	switch p := p.(type) {
	case ExponentialBackoff:
		return p.problems()
	case *ExponentialBackoff:
		if p != nil {
			return p.problems()
		}
	case ConstantBackoff:
		return p.problems()
	case *ConstantBackoff:
		if p != nil {
			return p.problems()
		}
	}
	return nil
}

func (b ExponentialBackoff) withDefaults() ExponentialBackoff {
	if b.InitialInterval <= 0 {
		b.InitialInterval = time.Second
	}
	if b.Multiplier <= 0 {
		b.Multiplier = 2
	}
	if b.MaxInterval <= 0 {
		b.MaxInterval = 5 * time.Minute
	}
	if b.MaxAttempts == 0 {
		b.MaxAttempts = 10
	}
	switch {
	case b.Jitter == NoJitter:
		b.Jitter = 0
	case b.Jitter <= 0:
		b.Jitter = 0.2
	case b.Jitter > 1:
		b.Jitter = 1
	}
	// Jitter adds up to the interval again, computed in float64: an
	// interval near the largest Duration (a "no cap" of math.MaxInt64)
	// overflowed to a negative delay, a redelivery at once.
	b.MaxInterval = min(b.MaxInterval, maxBackoffInterval)
	b.InitialInterval = min(b.InitialInterval, b.MaxInterval)
	return b
}

// maxBackoffInterval is the longest interval ExponentialBackoff works
// with: a quarter of the largest Duration (about 73 years), so the
// interval plus its jitter stays one. Any policy's delay is cut to it
// (retryDelay).
const maxBackoffInterval = time.Duration(math.MaxInt64 / 4)

// NextDelay implements RetryPolicy.
func (b ExponentialBackoff) NextDelay(deliveries int, _ error) (time.Duration, bool) {
	b = b.withDefaults()
	if b.MaxAttempts > 0 && deliveries >= b.MaxAttempts {
		return 0, false
	}
	bo := &backoff.ExponentialBackOff{
		InitialInterval:     b.InitialInterval,
		RandomizationFactor: b.Jitter,
		Multiplier:          b.Multiplier,
		MaxInterval:         b.MaxInterval,
		MaxElapsedTime:      0, // attempts, not wall time, bound the policy
		Stop:                backoff.Stop,
		Clock:               backoff.SystemClock,
	}
	bo.Reset()
	// The library is stateful; replaying it keeps this policy a pure
	// function of the delivery count. Once the interval reaches the cap every
	// further step is the same, so the replay stops there.
	d := bo.NextBackOff()
	grown := float64(b.InitialInterval)
	for k := 1; k < deliveries && grown < float64(b.MaxInterval); k++ {
		d = bo.NextBackOff()
		grown *= b.Multiplier
	}
	return d, true
}

// ConstantBackoff waits the same Delay after every failure.
type ConstantBackoff struct {
	// Delay before the next delivery; 0 redelivers at once. Must not be
	// negative.
	Delay time.Duration
	// MaxAttempts is the number of deliveries before giving up. Defaults
	// to 10. The special value RetryForever (-1) retries forever.
	MaxAttempts int
}

func (c ConstantBackoff) problems() []policyProblem {
	var out []policyProblem
	if c.Delay < 0 {
		out = append(out, policyProblem{"ConstantBackoff", "Delay", c.Delay, "0 (at once) or a positive duration"})
	}
	if c.MaxAttempts < RetryForever {
		out = append(out, policyProblem{"ConstantBackoff", "MaxAttempts", c.MaxAttempts, "a positive number of deliveries, 0 for the default 10, or RetryForever (-1)"})
	}
	return out
}

// NextDelay implements RetryPolicy.
func (c ConstantBackoff) NextDelay(deliveries int, _ error) (time.Duration, bool) {
	attempts := c.MaxAttempts
	if attempts == 0 {
		attempts = 10
	}
	if attempts > 0 && deliveries >= attempts {
		return 0, false
	}
	return c.Delay, true
}

// NoRetry gives up after the first failed delivery.
func NoRetry() RetryPolicy {
	return RetryPolicyFunc(func(int, error) (time.Duration, bool) { return 0, false })
}
