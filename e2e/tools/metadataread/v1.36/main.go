// Command metadataread reads a DRA device metadata file as a workload reads it, with
// the reader of k8s.io/dynamic-resource-allocation v0.36 (Kubernetes 1.36, which knows
// only metadata.resource.k8s.io/v1alpha1), and prints the object it decoded as JSON.
// gpudra's tests run it on the files the node agent writes: a reader built for 1.36
// must find the version it knows in a file that lists a newer one first.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"k8s.io/dynamic-resource-allocation/api/metadata"
	"k8s.io/dynamic-resource-allocation/devicemetadata"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: metadataread FILE")
		os.Exit(2)
	}
	f, err := os.Open(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer f.Close()
	var dm metadata.DeviceMetadata
	if err := devicemetadata.DecodeMetadataFromStream(json.NewDecoder(f), &dm); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	out := map[string]any{"apiVersion": "", "object": dm, "validation": ""}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
