package pgoutboxtest_test

import (
	"fmt"
	"runtime"
	"testing"
)

// exampleT is the testing.TB the examples run their test functions with:
// go test gives an Example no *testing.T. A failure is printed, so the
// example's output no longer matches and the example fails.
type exampleT struct {
	testing.TB
	cleanups []func()
}

func (t *exampleT) Helper()                      {}
func (t *exampleT) Name() string                 { return "Example" }
func (t *exampleT) Cleanup(f func())             { t.cleanups = append(t.cleanups, f) }
func (t *exampleT) Logf(string, ...any)          {}
func (t *exampleT) Errorf(f string, args ...any) { fmt.Printf("FAIL: "+f+"\n", args...) }
func (t *exampleT) Fatalf(f string, args ...any) { t.Errorf(f, args...); t.FailNow() }
func (t *exampleT) FailNow()                     { runtime.Goexit() }
func (t *exampleT) Skipf(f string, args ...any) {
	fmt.Printf("SKIP: "+f+"\n", args...)
	runtime.Goexit()
}

// runTest runs test as go test would run a test function: in a goroutine of
// its own, then its cleanups, last registered first.
func runTest(test func(t testing.TB)) {
	t := &exampleT{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		test(t)
	}()
	<-done
	for i := len(t.cleanups) - 1; i >= 0; i-- {
		t.cleanups[i]()
	}
}
