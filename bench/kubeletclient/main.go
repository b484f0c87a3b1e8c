// Command kubeletclient drives a DRA kubelet plugin the way the kubelet does: DRA v1
// NodePrepareResources / NodeUnprepareResources over the plugin's unix socket, one
// claim per call, with the kubelet's 45 s deadline. bench/prepare.py uses it so that
// the measurement includes a Go gRPC client, as in production, instead of a Python one.
//
// Input (stdin): a JSON list of {"namespace", "uid", "name"}; each claim gets its own
// goroutine that prepares and unprepares it in turn. Output (stdout): JSON with the
// per-call latencies, the wall time and this process's CPU time for the measured cycles.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
)

const callTimeout = 45 * time.Second

type claim struct {
	Namespace string `json:"namespace"`
	UID       string `json:"uid"`
	Name      string `json:"name"`
}

type result struct {
	PrepareMs   []float64 `json:"prepare_ms"`
	UnprepareMs []float64 `json:"unprepare_ms"`
	WallS       float64   `json:"wall_s"`
	CPUS        float64   `json:"cpu_s"`
	Errors      int       `json:"errors"`
	FirstError  string    `json:"first_error,omitempty"`
}

func cpuSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// cycle prepares and unprepares one claim; the error is what the kubelet would report.
func cycle(client drapb.DRAPluginClient, c claim) (time.Duration, time.Duration, error) {
	ref := []*drapb.Claim{{Namespace: c.Namespace, Uid: c.UID, Name: c.Name}}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	prepared, err := client.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: ref})
	cancel()
	mid := time.Now()
	if err == nil {
		if answer, ok := prepared.GetClaims()[c.UID]; !ok {
			err = fmt.Errorf("prepare of %s: no answer for the claim", c.UID)
		} else if answer.GetError() != "" {
			err = fmt.Errorf("prepare of %s: %s", c.UID, answer.GetError())
		}
	}
	ctx, cancel = context.WithTimeout(context.Background(), callTimeout)
	unprepared, uerr := client.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: ref})
	cancel()
	end := time.Now()
	if uerr == nil {
		if answer, ok := unprepared.GetClaims()[c.UID]; !ok {
			uerr = fmt.Errorf("unprepare of %s: no answer for the claim", c.UID)
		} else if answer.GetError() != "" {
			uerr = fmt.Errorf("unprepare of %s: %s", c.UID, answer.GetError())
		}
	}
	if err == nil {
		err = uerr
	}
	return mid.Sub(start), end.Sub(mid), err
}

// run spreads `cycles` over the claims, one goroutine per claim.
func run(client drapb.DRAPluginClient, claims []claim, cycles int, out *result) {
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i, c := range claims {
		count := cycles / len(claims)
		if i < cycles%len(claims) {
			count++
		}
		wg.Add(1)
		go func(c claim, count int) {
			defer wg.Done()
			for range count {
				prep, unprep, err := cycle(client, c)
				mu.Lock()
				out.PrepareMs = append(out.PrepareMs, ms(prep))
				out.UnprepareMs = append(out.UnprepareMs, ms(unprep))
				if err != nil {
					out.Errors++
					if out.FirstError == "" {
						out.FirstError = err.Error()
					}
				}
				mu.Unlock()
			}
		}(c, count)
	}
	wg.Wait()
}

func main() {
	socket := flag.String("socket", "", "the plugin's DRA socket")
	cycles := flag.Int("cycles", 1000, "measured prepare/unprepare cycles")
	warmup := flag.Int("warmup", 40, "cycles before the measurement")
	flag.Parse()
	var claims []claim
	if err := json.NewDecoder(os.Stdin).Decode(&claims); err != nil || len(claims) == 0 {
		fmt.Fprintf(os.Stderr, "kubeletclient: stdin must be a non-empty JSON list of claims: %v\n", err)
		os.Exit(2)
	}
	conn, err := grpc.NewClient("unix://"+*socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintf(os.Stderr, "kubeletclient: %v\n", err)
		os.Exit(2)
	}
	defer conn.Close()
	client := drapb.NewDRAPluginClient(conn)
	var warm result
	run(client, claims, *warmup, &warm)
	out := result{PrepareMs: []float64{}, UnprepareMs: []float64{}}
	cpu, start := cpuSeconds(), time.Now()
	run(client, claims, *cycles, &out)
	out.WallS = time.Since(start).Seconds()
	out.CPUS = cpuSeconds() - cpu
	out.Errors += warm.Errors
	if out.FirstError == "" {
		out.FirstError = warm.FirstError
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		os.Exit(2)
	}
}
